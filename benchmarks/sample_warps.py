"""What the code predictor's sampling kernel costs per call by its warps per program, in a CUDA graph.

`kernels/sampling.py` draws a row's code in one program: a top-k of the 2,048-entry codebook's int64 keys,
top-p and the exponential race. A code-predictor frame calls it 15 times, one after another. This times the
kernel over released-size logits (1, 8 and 16 rows, top-k 50, sampled rows) captured 20 times in one
graph (`gemv.graph_us`), at 2 to 16 warps, and checks that every warp count draws the same ids.

    python3 benchmarks/sample_warps.py --out $OUT/sample_warps.json      # GPU machine, seconds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from omnistage.engine.static_sampling import StaticRows
from omnistage.kernels.gemv import graph_us
from omnistage.kernels.sampling import sample_kernel

VOCAB, TOP_K = 2048, 50
WARPS = [2, 4, 8, 16]


def _rows(batch: int) -> StaticRows:
    rows = StaticRows.empty(batch, "cuda")
    rows.fill([False] * batch, [0.9] * batch, [0.8] * batch, list(range(batch)), [0] * batch)
    return rows


def call_us(logits: torch.Tensor, warps: int) -> float:
    rows = _rows(logits.shape[0])
    return graph_us(lambda: sample_kernel(logits, rows, TOP_K, warps))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="sample_warps.json")
    args = parser.parse_args()
    results = []
    for batch in (1, 8, 16):
        logits = torch.randn(
            batch, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(batch)
        )
        draws = {w: sample_kernel(logits, _rows(batch), TOP_K, w).tolist() for w in WARPS}
        assert all(d == draws[WARPS[0]] for d in draws.values()), draws
        us = {w: round(call_us(logits, w), 2) for w in WARPS}
        results.append({"rows": batch, "us": us})
        print(f"rows {batch:2}: " + "  ".join(f"{w} warps {t:6.2f} us" for w, t in us.items()), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
