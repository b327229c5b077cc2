"""Prompt rows over a long context through torch's FlashAttention instead of the paged kernel.

A long prompt's chunks (a 30 s video's 22k tokens go in 2,048-row chunks) attend over more keys with every
chunk. There our Triton kernel reached 222-232 TFLOP/s on an H100 after 10-20k keys, torch's varlen
FlashAttention 297-326 on the same keys gathered into one contiguous run, the gather ~55 µs a layer; at 2k keys
the two were equal (benchmarks/RESULTS.md, "A long prompt's attention: torch's FlashAttention beside ours").
So an eager step with prompt rows over a long context gathers every sequence's keys from their pages, in order,
and calls FlashAttention once with the sequences' key offsets. Graph captures and decode steps keep the paged
kernel: a graph's metadata does not know its keys on the host (`AttentionMetadata.num_keys` 0), and split-KV
decoding is the paged kernel's strength.

The gather is a step's only extra memory: at most `MAX_KEYS` keys, `scratch_bytes` of them, which the stage's
memory floor counts; a step that would gather more keeps the paged kernel.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from omnistage.models.layers.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from omnistage.kernels.long_attention import LongTiles

log = logging.getLogger(__name__)

MIN_ROWS = 128  # a step's longest chunk of prompt rows from which the gather pays
MIN_KEYS = 4096  # and its longest context: FlashAttention gained nothing at 2k keys
MAX_KEYS = 65536  # keys gathered at most in one step (the released Qwen3-Omni's context)
DTYPES = (torch.float16, torch.bfloat16)  # what FlashAttention takes: a float32 model keeps the paged kernel
CHECK_DTYPE = torch.bfloat16  # the start-up check's (`_agrees`): the released checkpoints' dtype

# varlen(q `[T, Hq, D]`, k `[K, Hkv, D]`, v, cu_q int32 `[B+1]`, cu_k int32 `[B+1]`, max_q, max_k, scale) ->
# `[T, Hq, D]`: each sequence's rows attending causally to its keys, the last row seeing every key
Varlen = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor
]


def applies(meta: AttentionMetadata, dtype: torch.dtype) -> bool:
    """Whether a step of `dtype` queries goes through the gather: 16-bit ones, prompt rows over a long context,
    its keys known on the host (no padding: `AttentionMetadata.build`) and within `MAX_KEYS`, and not while a
    graph is being captured."""
    return (
        dtype in DTYPES
        and meta.max_query_len >= MIN_ROWS
        and meta.max_seq_len >= MIN_KEYS
        and 0 < meta.num_keys <= MAX_KEYS
        and not (meta.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def key_slots(meta: AttentionMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's keys' flat KV slots in order (int64 `[num_keys]`) and where each sequence's keys start
    among them (int32 `[B+1]`), computed where the metadata is, without reading it back."""
    device = meta.seq_lens.device
    ends = meta.seq_lens.cumsum(0)
    cu_keys = torch.cat((ends.new_zeros(1), ends)).to(torch.int32)
    key = torch.arange(meta.num_keys, device=device)
    seq = torch.searchsorted(ends, key, right=True)
    position = key - cu_keys[seq]
    page = meta.block_tables[seq, torch.div(position, page_size, rounding_mode="floor")]
    return page.long() * page_size + position % page_size, cu_keys


def attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    varlen: Varlen,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`paged_attention`'s result for a step `applies` admits: the keys gathered from `kv_cache`
    `[2, pages, page_size, Hkv, D]` at `slots` (`key_slots`, the step's for every layer), then one `varlen`
    call."""
    at, cu_keys = key_slots(meta, kv_cache.shape[2]) if slots is None else slots
    flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, D]
    keys, values = flat[0].index_select(0, at), flat[1].index_select(0, at)
    cu_rows = meta.query_start_loc
    return varlen(q, keys, values, cu_rows, cu_keys, meta.max_query_len, meta.max_seq_len, scale)


def scratch_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The most a step's gather holds at once: `MAX_KEYS` keys and values and their slots (none for a dtype
    that never gathers)."""
    if dtype not in DTYPES:
        return 0
    element = torch.empty(0, dtype=dtype).element_size()
    return MAX_KEYS * (2 * kv_heads * head_dim * element + 8)


def flash_varlen(device: torch.device) -> Varlen | None:
    """torch's varlen FlashAttention on `device`, where this torch has it and it takes fewer K/V heads than
    query heads (GQA) and a causal mask aligned at each sequence's last key; None elsewhere. Checked on a
    small case against plain attention: a torch whose call or alignment differs runs the paged kernel."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    options: dict[str, object] = {"enable_gqa": True} if "enable_gqa" in params else {}
    options |= {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # type: ignore[no-untyped-def]
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **options)

    try:
        agrees = _agrees(varlen, device)
    except Exception as exc:  # this torch or this GPU has no such kernel
        log.info("long prompt chunks on the paged kernel: torch's varlen FlashAttention failed (%s)", exc)
        return None
    if not agrees:
        log.warning("long prompt chunks on the paged kernel: torch's varlen FlashAttention differs from SDPA")
        return None
    log.info(
        "prompt chunks of %d+ rows over %d+ keys: torch's varlen FlashAttention over their keys gathered from "
        "the pages (--no-flash-prefill: the paged kernel)",
        MIN_ROWS,
        MIN_KEYS,
    )
    return varlen


def triton_varlen(device: torch.device, tiles: LongTiles | None = None) -> Varlen | None:
    """omnistage's Triton kernel for the same call (`kernels/long_attention.py`, `tiles` or its defaults),
    checked as `flash_varlen` is; None where it fails or differs."""
    from omnistage.kernels.long_attention import LONG_TILES, long_attention

    chosen = tiles or LONG_TILES

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # type: ignore[no-untyped-def]
        return long_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, chosen)

    try:
        agrees = _agrees(varlen, device)
    except Exception as exc:  # no Triton build for this device
        log.info("long prompt chunks on the paged kernel: the Triton long-prefill kernel failed (%s)", exc)
        return None
    if not agrees:
        log.warning(
            "long prompt chunks on the paged kernel: the Triton long-prefill kernel differs from SDPA"
        )
        return None
    log.info(
        "prompt chunks of %d+ rows over %d+ keys: the Triton long-prefill kernel over their keys gathered from "
        "the pages (--long-prefill-kernel flash: torch's FlashAttention)",
        MIN_ROWS,
        MIN_KEYS,
    )
    return varlen


def _agrees(varlen: Varlen, device: torch.device) -> bool:
    """Two sequences (5 rows after 7 keys, 3 rows alone), 4 query heads over 2 K/V heads, against SDPA."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 12), (3, 3)]
    outs, qs, ks, vs = [], [], [], []
    for rows, keys in shapes:
        q = torch.randn(rows, 4, 64, generator=generator)
        k, v = torch.randn(2, keys, 2, 64, generator=generator)
        mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
            ).transpose(0, 1)
        )
        qs.append(q)
        ks.append(k)
        vs.append(v)
    q, k, v = (torch.cat(t).to(device, CHECK_DTYPE) for t in (qs, ks, vs))
    cu_q = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 12, 15], dtype=torch.int32, device=device)
    got = varlen(q, k, v, cu_q, cu_k, 5, 12, 64**-0.5).float().cpu()
    return torch.allclose(got, torch.cat(outs), atol=3e-2, rtol=3e-2)
