"""What a decode step's paged attention costs per layer on the GPU, by the number of KV splits.

`kernels/attention.py` splits each sequence's keys across programs in a decode step (`decode_splits`
picks the count from the batch's shape only, so that a captured graph replays with it). This times the K/V
write and the attention of one layer (`CudaAttentionBackend.forward`, what a decoder layer calls), captured
20 times in one CUDA graph (`gemv.graph_us`) and replayed, for the released stages' head layouts, context
lengths and batches, at each split count, and marks the one `decode_splits` picks. The `varlen` columns run
the same decode rows through the prefill path's tiles (`paged_attention(varlen=True)`), as a step with prompt
rows beside them does, at the default tile (64 rows, 64 keys, 4 warps) and at others (`VARLEN_TILES`).

    python3 benchmarks/decode_attention.py --out $OUT/decode_attention.json     # GPU machine, under a minute
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from omnistage.kernels.attention import Tiles, decode_splits, paged_attention, write_kv
from omnistage.kernels.gemv import graph_us
from omnistage.models.layers.attention_metadata import AttentionMetadata

# (stage, query heads, KV heads, head dim) at the released sizes (omnistage/data/*.config.json)
LAYOUTS = [("Qwen3-ASR", 16, 8, 128), ("Thinker", 32, 4, 128), ("Talker", 16, 2, 128)]
# (batch, context tokens); (128, 100): Qwen3-ASR's steady state at c=128, LibriSpeech-like clips
CASES = [(1, 256), (1, 1600), (1, 4096), (16, 1600), (64, 400), (128, 100), (128, 400)]
SPLITS = [1, 2, 4, 8, 16, 32, 64]
VARLEN_TILES = {
    "varlen": Tiles(),
    "varlen 16x64": Tiles(rows=16),
    "varlen 32x64": Tiles(rows=32),
    "varlen 64x32": Tiles(keys=32),
    "varlen 64x64 w8": Tiles(warps=8),
}
PAGE = 16


def case(heads: int, kv_heads: int, dim: int, batch: int, context: int) -> dict[str, float]:
    pages_per_seq = -(-context // PAGE)
    cache = torch.randn(
        2, batch * pages_per_seq + 1, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16
    )
    chunks = [(context - 1, 1, list(range(b * pages_per_seq, (b + 1) * pages_per_seq))) for b in range(batch)]
    meta = AttentionMetadata.build(chunks, PAGE).to_device(torch.device("cuda"))[0]
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    scale = dim**-0.5
    times = {}
    for splits in SPLITS:

        def call(splits=splits) -> None:
            write_kv(cache, k, v, meta.slot_mapping)
            paged_attention(q, cache, meta, scale, out=out, num_splits=splits)

        times[splits] = round(graph_us(call), 2)
    for name, tiles in VARLEN_TILES.items():

        def varlen(tiles=tiles) -> None:
            write_kv(cache, k, v, meta.slot_mapping)
            paged_attention(q, cache, meta, scale, out=out, tiles=tiles, varlen=True)

        times[name] = round(graph_us(varlen), 2)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="decode_attention.json")
    args = parser.parse_args()
    rows = []
    columns = [*SPLITS, *VARLEN_TILES]
    print(
        f"{'stage':10} {'batch':>5} {'context':>7} " + " ".join(f"{s:>7}" for s in columns) + "  picked  best"
    )
    for stage, heads, kv_heads, dim in LAYOUTS:
        for batch, context in CASES:
            times = case(heads, kv_heads, dim, batch, context)
            picked = decode_splits(batch, kv_heads, torch.device("cuda"))
            best = min(SPLITS, key=times.get)
            rows.append(
                {
                    "stage": stage,
                    "batch": batch,
                    "context": context,
                    "us": times,
                    "picked": picked,
                    "best": best,
                }
            )
            cells = " ".join(f"{times[s]:7.2f}" for s in columns)
            print(f"{stage:10} {batch:5} {context:7} {cells}  {picked:6}  {best:4}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
