"""What one layer's paged attention costs in a step with prompt rows, as the prefill graphs pad it.

A server under load prefills its arrivals beside its decode rows: Qwen3-ASR at c=128 runs steps of ~125 decode
rows and a few prompt chunks of ~75 tokens. A prefill graph holds such a step in its bucket's shape: the
bucket's rows (padding rows of no sequence past the step's), up to 128 sequence slots (empty ones past the
step's sequences) and a tile height of the whole bucket. This times the K/V write and the attention of one
layer (`write_kv` + `paged_attention`), captured 20 times in one CUDA graph (`gemv.graph_us`) and replayed,
for the released stages' head layouts, at each bucket such a step fits, and for one long prompt alone.
Multiply by the layers (Qwen3-ASR 0.6B 28, 1.7B 28; Thinker 48; Talker 20) for a step's share.

    python3 benchmarks/prefill_attention.py --out $OUT/prefill_attention.json     # GPU machine, a minute

Run it with another tree's package on the path (`PYTHONPATH=<tree> python3 benchmarks/prefill_attention.py`,
as `before_after.sh run prefill_attention` does) to compare kernels: without `--sweep` it calls only what
every tree's `paged_attention` takes.
`--sweep` times the prefill program's shapes (`kernels.attention.Tiles`: tile rows, keys at a time, warps,
pipeline stages) instead, on the loaded step and on a long prompt's 2,048-row chunks after 0, 10k and 20k
cached tokens (a 30 s video's prefill), and marks the fastest of each against the default.
`--long` times those long chunks (the Thinker's and the Talker's head layouts) in our kernel beside torch's
FlashAttention (`torch.nn.attention.varlen.varlen_attn`, called as the engine calls it:
`long_prefill.flash_varlen`) over the same keys gathered into one contiguous run, the gather timed apart, and
the engine's whole path (dispatch, gather and kernel); each with its TFLOP/s, and the largest difference
between the two kernels' outputs: how far a video's prefill attention is from the fastest kernel torch ships,
and whether that kernel's causal alignment (the chunk's last row sees every key) is ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omnistage.kernels.attention import paged_attention, write_kv
from omnistage.kernels.gemv import graph_us
from omnistage.kernels.timing import cuda_ms
from omnistage.models.layers.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from omnistage.engine.attention.cuda import CudaAttentionBackend

# (stage, query heads, KV heads, head dim) at the released sizes (omnistage/data/*.config.json)
LAYOUTS = [("Qwen3-ASR", 16, 8, 128), ("Thinker", 32, 4, 128), ("Talker", 16, 2, 128)]
PAGE = 16
SLOTS = 128  # a prefill graph's sequence slots (Qwen3-ASR's max_num_seqs)


def loaded_step() -> list[tuple[int, int]]:
    """(cached tokens, new tokens) per sequence: 125 decode rows at 80-200 tokens of context and three
    prompts of 75 tokens (a 4.7 s clip's), Qwen3-ASR at c=128 in its steady state."""
    decodes = [(80 + (37 * i) % 120, 1) for i in range(125)]
    return decodes + [(0, 75)] * 3


def case(
    heads: int,
    kv_heads: int,
    dim: int,
    chunks: list[tuple[int, int]],
    bucket: int | None,
    tiles: Any = None,
) -> float:
    """µs of one layer over `chunks`, padded to `bucket` rows and SLOTS sequences as a prefill graph pads
    a step (None: as an eager step runs it, unpadded), in programs of `tiles`' shape (None: the kernel's
    own)."""
    tables, page = [], 0
    for cached, new in chunks:
        pages = -(-(cached + new) // PAGE)
        tables.append(list(range(page, page + pages)))
        page += pages
    rows = sum(new for _, new in chunks)
    meta = AttentionMetadata.build(
        [(cached, new, t) for (cached, new), t in zip(chunks, tables)],
        PAGE,
        pad_rows=0 if bucket is None else bucket - rows,
    )
    if bucket is not None:
        empty = SLOTS - len(chunks)
        meta = dataclasses.replace(
            meta,
            query_start_loc=torch.cat([meta.query_start_loc, torch.full((empty,), rows, dtype=torch.int32)]),
            seq_lens=torch.cat([meta.seq_lens, torch.zeros(empty, dtype=meta.seq_lens.dtype)]),
            block_tables=torch.cat(
                [meta.block_tables, meta.block_tables.new_zeros(empty, meta.block_tables.shape[1])]
            ),
            max_query_len=bucket,
        )
    meta = meta.to_device(torch.device("cuda"))[0]
    total = meta.slot_mapping.shape[0]
    cache = torch.randn(2, page + 1, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.zeros_like(q)
    scale = dim**-0.5

    def call() -> None:
        write_kv(cache, k, v, meta.slot_mapping)
        paged_attention(q, cache, meta, scale, out=out, **({} if tiles is None else {"tiles": tiles}))

    return round(graph_us(call), 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="prefill_attention.json")
    parser.add_argument("--sweep", action="store_true", help="time the tile shapes instead")
    parser.add_argument("--long", action="store_true", help="long chunks, ours beside FlashAttention")
    args = parser.parse_args()
    if args.sweep:
        return sweep(args.out)
    if args.long:
        return long_chunks(args.out)
    workloads = [("loaded step", loaded_step(), b) for b in (None, 384, 512, 1024, 2048)]
    workloads += [("one 2,048-token prompt", [(0, 2048)], b) for b in (None, 2048)]
    rows = []
    print(f"{'stage':10} {'step':24} {'bucket':>7} {'us/layer':>9}")
    for stage, heads, kv_heads, dim in LAYOUTS:
        for name, chunks, bucket in workloads:
            us = case(heads, kv_heads, dim, chunks, bucket)
            rows.append(dict(stage=stage, step=name, bucket=bucket, us=us))
            print(f"{stage:10} {name:24} {bucket or 'eager':>7} {us:9.2f}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


def sweep(out: str) -> None:
    from omnistage.kernels.attention import PREFILL_TILES, Tiles  # this tree's kernel only

    shapes = [
        Tiles(rows, keys, warps, stages)
        for rows in (64, 128)
        for keys in (32, 64, 128)
        for warps in (4, 8)
        for stages in (None, 2)
    ]
    workloads = [("Qwen3-ASR", 16, 8, 128, "loaded step", loaded_step(), 512)]
    workloads += [
        ("Thinker", 32, 4, 128, f"2,048 rows after {cached:,}", [(cached, 2048)], None)
        for cached in (0, 10_000, 20_000)
    ]
    rows = []
    for stage, heads, kv_heads, dim, name, chunks, bucket in workloads:
        times: dict[Tiles, float | None] = {}
        for tiles in shapes:
            try:
                times[tiles] = case(heads, kv_heads, dim, chunks, bucket, tiles)
            except Exception as exc:  # a shape past the SM's registers or shared memory
                print(f"{stage} {name} {tiles}: {type(exc).__name__}", flush=True)
                times[tiles] = None
        timed = {t: us for t, us in times.items() if us is not None}
        best = min(timed, key=timed.__getitem__)
        for tiles, us in times.items():
            mark = (" default" if tiles == PREFILL_TILES else "") + (" best" if tiles == best else "")
            shown = f"{us:9.2f}" if us is not None else f"{'-':>9}"
            print(f"{stage:10} {name:24} {tiles} {shown}{mark}", flush=True)
            rows.append(dict(stage=stage, step=name, tiles=vars(tiles), us=us))
    Path(out).write_text(json.dumps(rows, indent=2) + "\n")


def long_case(
    heads: int, kv_heads: int, dim: int, cached: int, engine: CudaAttentionBackend, new: int = 2048
) -> dict[str, Any]:
    """One long prompt's chunk of `new` rows after `cached` tokens: ours, the gather and FlashAttention, and
    the `engine` backend's own call."""
    total = cached + new
    pages = -(-total // PAGE)
    meta = AttentionMetadata.build([(cached, new, list(range(pages)))], PAGE)
    meta = meta.to_device(torch.device("cuda"))[0]
    cache = torch.randn(2, pages, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(new, heads, dim, device="cuda", dtype=torch.bfloat16)
    ours_out = torch.zeros_like(q)
    slots = torch.arange(total, device="cuda")
    kv = cache.view(2, pages * PAGE, kv_heads, dim)
    us = 1e3 * cuda_ms(lambda: paged_attention(q, cache, meta, dim**-0.5, out=ours_out))
    gather_us = 1e3 * cuda_ms(lambda: (kv[0].index_select(0, slots), kv[1].index_select(0, slots)))
    flops = 4 * heads * dim * new * (cached + (new + 1) / 2)  # QK and PV over the causal triangle
    row: dict[str, Any] = dict(cached=cached, rows=new, ours_us=round(us, 1), gather_us=round(gather_us, 1))
    row["ours_tflops"] = round(flops / us / 1e6, 1)
    from omnistage.engine.attention import long_prefill  # this tree's, as `--long` is (not the default mode)

    # what the engine's backend runs for this step, the keys' slots and their gather included
    engine_us = 1e3 * cuda_ms(lambda: engine.attend(q, cache, meta, dim**-0.5))
    gathers = engine.flash is not None and long_prefill.applies(meta)
    row.update(engine_us=round(engine_us, 1), engine_path="flash" if gathers else "paged")
    try:
        if engine.flash is None:
            raise RuntimeError(
                "this torch has no varlen FlashAttention the engine takes (long_prefill.flash_varlen)"
            )
        k, v = kv[0].index_select(0, slots), kv[1].index_select(0, slots)
        cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, total], dtype=torch.int32, device="cuda")
        varlen = engine.flash

        def flash() -> torch.Tensor:  # the engine's own call, on keys gathered once
            return varlen(q, k, v, cu_q, cu_k, new, total, dim**-0.5)

        flash_us = 1e3 * cuda_ms(flash)
        row.update(flash_us=round(flash_us, 1), flash_tflops=round(flops / flash_us / 1e6, 1))
        row["max_diff"] = (flash().float() - ours_out.float()).abs().max().item()
    except Exception as exc:  # this torch has no such kernel, or it refuses the layout
        row["flash_error"] = f"{type(exc).__name__}: {exc}"
    return row


def long_chunks(out: str) -> None:
    from omnistage.engine.attention import backend_for
    from omnistage.engine.attention.cuda import CudaAttentionBackend

    engine = backend_for(torch.device("cuda"))
    assert isinstance(engine, CudaAttentionBackend)
    rows = []
    print("stage     cached   ours us  TFLOP/s  flash us  TFLOP/s gather us  max diff  engine us (path)")
    for stage, heads, kv_heads, dim in LAYOUTS[1:]:
        for cached in (0, 4_096, 10_000, 20_000):
            row = {"stage": stage, **long_case(heads, kv_heads, dim, cached, engine)}
            rows.append(row)
            flash = (
                f"{row['flash_us']:9.1f} {row['flash_tflops']:8.1f}" if "flash_us" in row else f"{'-':>18}"
            )
            last = f"{row['max_diff']:9.3g}" if "max_diff" in row else row["flash_error"]
            print(
                f"{stage:8} {cached:>7,} {row['ours_us']:9.1f} {row['ours_tflops']:8.1f} {flash} "
                f"{row['gather_us']:9.1f} {last} {row['engine_us']:9.1f} ({row['engine_path']})",
                flush=True,
            )
    Path(out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
