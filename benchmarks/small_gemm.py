"""What a projection of a few rows costs on the GPU: cuBLAS (`F.linear`) against a Triton GEMV, in CUDA graphs.

A code-predictor frame is 15 steps of 5 layers at the batch's few rows, and its profile (benchmarks/RESULTS.md,
"Where a speaking step's time goes") has its GEMMs at ~8.6 µs each for weights of 2-12 MB, a fifth of what the
H200's memory could stream; a Qwen3-ASR or Thinker decode step at c=1 is the same kind of GEMM. This times, for
each projection of the released stages (fused q/k/v and gate/up as the models run them) and each row count:
- cuBLAS: `F.linear`, as every stage calls it today;
- GEMV: one Triton program per block of output columns, each streaming its weight rows once for all the rows
  of the input (`omnistage/kernels/gemv.py`, which the speech stages adopt per shape where it wins);
each captured 20 times in one CUDA graph and replayed, so that the figure is a kernel's time in a graph, launch
gaps included, as the stages' graphs run them. It checks the GEMV's output against cuBLAS's first. Then the
whole code-predictor frame (`FrameGraphs`, released size, random weights, its layers not compiled in
either case) replayed with every projection of up to 16 rows on cuBLAS, then on the GEMV (`F.linear` patched
for the capture): what the GEMV would change in a speaking step.

    python3 benchmarks/small_gemm.py --out $OUT/small_gemm.json     # GPU machine, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.gemv import gemv, graph_us
from omnistage.kernels.timing import cuda_ms

# (stage, projection, out features, in features) at the released sizes (omnistage/data/*.config.json)
SHAPES = [
    ("code predictor", "qkv", 4096, 1024),
    ("code predictor", "o", 1024, 2048),
    ("code predictor", "gate_up", 6144, 1024),
    ("code predictor", "down", 1024, 3072),
    ("code predictor", "lm_head", 2048, 1024),
    ("Talker", "qkv", 2560, 1024),
    ("Talker", "o", 1024, 2048),
    ("Talker", "shared gate_up", 1536, 1024),
    ("Talker", "shared down", 1024, 768),
    ("Thinker", "qkv", 5120, 2048),
    ("Thinker", "o", 2048, 4096),
    ("Qwen3-ASR 1.7B", "qkv", 4096, 2048),
    ("Qwen3-ASR 1.7B", "o", 2048, 2048),
    ("Qwen3-ASR 1.7B", "gate_up", 12288, 2048),
    ("Qwen3-ASR 1.7B", "down", 2048, 6144),
]
ROWS = [1, 2, 4, 8, 16]


@contextlib.contextmanager
def gemv_projections(max_rows: int = 16) -> Iterator[None]:
    """`F.linear` (and so every `nn.Linear`) on the GEMV for inputs of up to `max_rows` rows without a bias."""
    original = F.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if bias is None and rows <= max_rows and weight.is_contiguous():
            out = gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return original(x, weight, bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


def frame_ms(buckets: list[int]) -> list[dict]:
    """A code-predictor frame's replay per bucket, cuBLAS against the GEMV; ms, median of 50 replays."""
    from omnistage.bench.skeletons import released_skeleton
    from omnistage.engine.graphs.frames import FrameGraphs
    from omnistage.models.loader import LoadOptions, fill_random_
    from omnistage.models.qwen3_omni.code_predictor import load_code_predictor
    from omnistage.models.qwen3_omni.config import Qwen3OmniConfig

    checkpoint = released_skeleton()
    predictor = load_code_predictor(
        checkpoint, LoadOptions(torch.bfloat16, "cuda", load_format="dummy")
    ).eval()
    talker = Qwen3OmniConfig.from_dir(checkpoint).talker.text
    code0 = nn.Embedding(talker.vocab_size, talker.hidden_size, device="cuda", dtype=torch.bfloat16)
    fill_random_(code0, seed=1)
    code0.requires_grad_(False)
    rows = []
    for name, patch in (("cuBLAS", contextlib.nullcontext), ("GEMV", gemv_projections)):
        runner = FrameGraphs(predictor, code0, 50, max(buckets))
        with patch():
            runner.capture(buckets)
        for batch in buckets:
            hidden = torch.randn(batch, predictor.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, talker.vocab_size, (batch,), device="cuda")

            def run(hidden=hidden, ids=ids, batch=batch, runner=runner) -> None:
                runner.run(hidden, ids, greedy=[False] * batch, temperature=[1.0] * batch, top_p=[0.8] * batch,
                           seeds=list(range(batch)), draws=[0] * batch)  # fmt: skip

            for _ in range(5):
                run()
            torch.cuda.synchronize()
            rows.append(
                {"projections": name, "batch": batch, "frame_ms": round(cuda_ms(run, 50, warmup=0), 3)}
            )
            print(f"code-predictor frame, batch {batch:>2}, {name:6}: {rows[-1]['frame_ms']:.3f} ms")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("small_gemm.json"))
    parser.add_argument("--block-n", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    print(
        f"{'stage':16} {'proj':14} {'rows':>4} {'MB':>6} {'cuBLAS us':>9} {'GEMV us':>8} {'block':>5} {'GB/s':>6}"
    )
    for stage, name, out_features, in_features in SHAPES:
        weight = (
            torch.randn(out_features, in_features, dtype=torch.bfloat16, device="cuda") / in_features**0.5
        )
        megabytes = weight.numel() * weight.element_size() / 1e6
        for rows in ROWS:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
            want = F.linear(x, weight)
            cublas = graph_us(lambda x=x, w=weight: F.linear(x, w))
            best = None
            for block_n in args.block_n:
                got = gemv(x, weight, block_n)
                error = (got.float() - want.float()).abs().max().item()
                if error > 2e-2 * want.float().abs().max().item():
                    raise AssertionError(f"{stage} {name} rows {rows} block {block_n}: GEMV off by {error}")
                us = graph_us(lambda x=x, w=weight, b=block_n: gemv(x, w, b))
                if best is None or us < best[0]:
                    best = (us, block_n)
            row = {
                "stage": stage, "projection": name, "out_features": out_features, "in_features": in_features,
                "rows": rows, "weight_mb": round(megabytes, 2), "cublas_us": round(cublas, 2),
                "gemv_us": round(best[0], 2), "gemv_block_n": best[1],
                "gemv_gb_per_s": round(megabytes * 1e3 / best[0], 1),
                "cublas_gb_per_s": round(megabytes * 1e3 / cublas, 1),
            }  # fmt: skip
            results.append(row)
            print(
                f"{stage:16} {name:14} {rows:>4} {megabytes:>6.1f} {cublas:>9.2f} {best[0]:>8.2f} "
                f"{best[1]:>5} {row['gemv_gb_per_s']:>6.0f}"
            )
    frames = frame_ms([1, 16])
    payload = {"gpu": torch.cuda.get_device_name(), "results": results, "code_predictor_frames": frames}
    args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
