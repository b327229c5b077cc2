"""torch's SDPA backends on one long prompt's chunk, beside the varlen FlashAttention the engine calls there.

A 30 s video's prefill is 22k tokens in 2,048-row chunks; its attention is half its FLOPs, and the engine
sends such chunks to torch's varlen FlashAttention over their keys gathered from the pages
(`engine.attention.long_prefill`), 297-326 TFLOP/s on an H100 (benchmarks/RESULTS.md, "A long prompt's
attention"). torch ships other kernels behind `scaled_dot_product_attention`: cuDNN's fused attention, its own
FlashAttention and the memory-efficient one. This times each on the same chunk (one sequence: the chunk's rows
over its cached keys and its own, causal, the last row seeing every key), for the Thinker's and the Talker's
head layouts, with the largest difference from the varlen call's output:

- `varlen`: the engine's call (`long_prefill.flash_varlen`), keys already gathered;
- `<backend>`: SDPA under that backend alone, the mask `causal_lower_right` (`is_causal` when nothing is
  cached), K/V heads shared (`enable_gqa`);
- `<backend> expanded`: the same with K/V repeated to the query heads, for a backend that refuses GQA;
- `cudnn split`: cuDNN twice, the rows over the cached keys unmasked and over their own causally, merged by
  their log-sum-exps: the one form in which cuDNN's causal mask (aligned at the first key) serves a chunk
  after cached tokens;
- `triton`: omnistage's own kernel for the varlen call (`kernels/long_attention.py`, `--long-prefill-kernel
  triton`), with its default tiles, and with `--triton-sweep` each candidate tile (`triton MxN wW sS tma|ptr`,
  `packed` for a K/V head's group in a tile).

    python3 benchmarks/sdpa_long.py --out $OUT/sdpa_long.json      # GPU machine, under a minute
    python3 benchmarks/sdpa_long.py --rows 8192,7353 --out ...     # a video's whole prompt in a step
    python3 benchmarks/sdpa_long.py --rows 7353,7400,7000 --pad-to 512 --out ...   # cuDNN's plans by bucket
    python3 benchmarks/sdpa_long.py --rows 2048,8192 --cached 0,10000 --triton-sweep --kernels varlen,triton,cudnn

A backend that refuses a case gets its error in the row instead of a time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from omnistage.engine.attention.long_prefill import flash_varlen
from omnistage.kernels.long_attention import LONG_TILES, LongTiles, long_attention
from omnistage.kernels.timing import cuda_ms

LAYOUTS = [("Thinker", 32, 4, 128), ("Talker", 16, 2, 128)]  # (stage, query heads, K/V heads, head dim)
# the Triton kernel's candidate tiles (rows, keys, warps, stages; blocks by descriptors unless tma=False; a K/V head's
# group packed in a tile with pack=True): each compiles for sm_90 without spills, which
# tests/unit/kernels/test_long_attention_compiles.py checks for every one
TRITON_SWEEP = [
    LongTiles(128, 64, 8, 3, tma=False),
    LongTiles(128, 64, 8, 2),
    LongTiles(128, 64, 8, 4),
    LongTiles(128, 32, 8, 3),
    LongTiles(128, 128, 8, 2),
    LongTiles(64, 64, 4, 3),
    LongTiles(128, 64, 8, 3, pack=True),
    LongTiles(64, 64, 4, 3, pack=True),
]
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def sdpa(backend: SDPBackend, q, k, v, cached: int, scale: float, expand: bool) -> torch.Tensor:
    """[rows, Hq, D] of the chunk's rows `q` over keys `k`, `v` [keys, Hkv, D] under `backend` alone."""
    rows, heads = q.shape[0], q.shape[1]
    if expand:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    mask = None if cached == 0 else causal_lower_right(rows, k.shape[0])
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=cached == 0, scale=scale, enable_gqa=not expand
        )
    return out[0].transpose(0, 1)


def cudnn_split(q, k, v, cached: int, scale: float) -> torch.Tensor:
    """The chunk through cuDNN in two calls merged by their log-sum-exps: rows over the cached keys (no mask)
    and over their own keys (causal from the first), K/V repeated to the query heads."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    parts = []
    for keys, causal in ((slice(0, cached), False), (slice(cached, None), True)):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qh, kh[:, :, keys], vh[:, :, keys], None, True, 0.0, causal, False, scale=scale
        )[:2]
        parts.append((out.float(), lse.reshape(out.shape[:-1]).float()))
    (a, lse_a), (b, lse_b) = parts
    lse = torch.logaddexp(lse_a, lse_b)
    merged = a * (lse_a - lse).exp()[..., None] + b * (lse_b - lse).exp()[..., None]
    return merged.to(q.dtype)[0].transpose(0, 1)


def timed(call: Callable[[], torch.Tensor], want: torch.Tensor, flops: float) -> dict[str, Any]:
    """Median µs after a warm-up, and the first call's wall ms: what a shape never seen costs (cuDNN builds
    a plan for each new one)."""
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first_ms = 1e3 * (time.perf_counter() - start)
        us = 1e3 * cuda_ms(call)
        diff = (call().float() - want.float()).abs().max().item()
    except Exception as exc:  # the backend refuses this layout or this mask
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1), "max_diff": diff, "first_ms": first_ms}


def cudnn_padded(q, k, v, scale: float, pad_to: int) -> torch.Tensor:
    """A fresh prompt (no cached keys) through cuDNN with its rows, keys and values padded with zeros at the end
    to a multiple of `pad_to`, then its own rows taken: exact, as the causal mask keeps every real row from the
    padding after it, and one cuDNN plan serves every length of a bucket."""
    rows = q.shape[0]
    padded = -(-rows // pad_to) * pad_to
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded - rows)) for t in (q, k, v))
    return sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, 0, scale, expand=False)[:rows]


def chunk_row(
    heads: int,
    kv_heads: int,
    dim: int,
    cached: int,
    new: int = 2048,
    pad_to: int = 0,
    triton_tiles: tuple[LongTiles, ...] = (LONG_TILES,),
    only: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Each kernel's time on one chunk (`only`: those kernels alone, every Triton tile under `triton`)."""
    varlen = flash_varlen(torch.device("cuda"))
    assert varlen is not None, "this torch has no varlen FlashAttention the engine takes"
    total, scale = cached + new, dim**-0.5
    generator = torch.Generator(device="cuda").manual_seed(cached)
    q = torch.randn(new, heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = torch.randn(2, total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, total], dtype=torch.int32, device="cuda")
    flops = 4 * heads * dim * new * (cached + (new + 1) / 2)  # QK and PV over the causal triangle
    want = varlen(q, k, v, cu_q, cu_k, new, total, scale)
    kernels: dict[str, Any] = {
        "varlen": timed(lambda: varlen(q, k, v, cu_q, cu_k, new, total, scale), want, flops)
    }
    for name, backend in BACKENDS.items():
        for expand in (False, True):
            label = f"{name} expanded" if expand else name
            if only and label not in only:
                continue
            kernels[label] = timed(
                lambda b=backend, e=expand: sdpa(b, q, k, v, cached, scale, e), want, flops
            )
    for tiles in triton_tiles if not only or "triton" in only else ():
        label = (
            "triton"
            if tiles == LONG_TILES
            else f"triton {tiles.rows}x{tiles.keys} w{tiles.warps} s{tiles.stages} {'tma' if tiles.tma else 'ptr'}{' packed' if tiles.pack else ''}"
        )
        kernels[label] = timed(
            lambda t=tiles: long_attention(q, k, v, cu_q, cu_k, new, total, scale, t), want, flops
        )
    if cached and (not only or "cudnn split" in only):
        kernels["cudnn split"] = timed(lambda: cudnn_split(q, k, v, cached, scale), want, flops)
    elif pad_to and not cached:
        kernels[f"cudnn padded to {pad_to}"] = timed(
            lambda: cudnn_padded(q, k, v, scale, pad_to), want, flops
        )
    return {"cached": cached, "rows": new, "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="sdpa_long.json")
    parser.add_argument(
        "--rows",
        default="2048",
        help="the chunk's rows, comma separated: 8192 is a step's budget for videos; an odd count is a prompt "
        "length no call has had yet (every first call of a row count is timed)",
    )
    parser.add_argument(
        "--cached", default="0,4096,10000,20000", help="keys cached before the chunk, comma separated"
    )
    parser.add_argument(
        "--pad-to",
        type=int,
        default=0,
        help="also cuDNN on each fresh prompt's rows padded to a multiple of this: row counts of one bucket, "
        "given one after the other (e.g. --rows 7353,7400), show whether the plan is built once",
    )
    parser.add_argument(
        "--triton-sweep",
        action="store_true",
        help="the Triton kernel with each candidate tile, not only its default",
    )
    parser.add_argument(
        "--kernels",
        default="",
        help="time only these kernels, comma separated (varlen, the SDPA backends, cudnn split, triton: every "
        "Triton tile); default every one",
    )
    args = parser.parse_args()
    only = frozenset(filter(None, args.kernels.split(",")))
    tiles = tuple(dict.fromkeys((LONG_TILES, *TRITON_SWEEP))) if args.triton_sweep else (LONG_TILES,)
    print(torch.cuda.get_device_name(), torch.__version__, "cuDNN", torch.backends.cudnn.version())
    rows = []
    for stage, heads, kv_heads, dim in LAYOUTS:
        for new, cached in itertools.product(
            map(int, args.rows.split(",")), map(int, args.cached.split(","))
        ):
            row = chunk_row(heads, kv_heads, dim, cached, new, args.pad_to, tiles, only)
            rows.append(row := {"stage": stage, **row})
            for name, result in row["kernels"].items():
                shown = (
                    f"{result['us']:9.1f} us {result['tflops']:7.1f} TFLOP/s  max diff {result['max_diff']:.3g}  "
                    f"first {result['first_ms']:.1f} ms"
                    if "us" in result
                    else result["error"]
                )
                print(f"{stage:8} {new:>6,} {cached:>7,} {name:20} {shown}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
