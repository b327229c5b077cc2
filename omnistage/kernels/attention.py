"""Paged attention in Triton: the GPU fast path, CUDA-graph safe.

`_write_kv` stores each row's k/v at its slot (rows with slot -1 write nothing). `_paged_attention`
walks each sequence's page table with an online softmax; one program owns a tile of a sequence's new
tokens for one KV head and all the query heads that share it (GQA), so K/V are read once per tile.
Decode (one new token) and ragged prefill chunks over cached pages are the same kernel: only the tile
height differs. Decode also splits each sequence's keys across programs (split-KV, so a batch of one
still fills the GPU) and `_combine_splits` merges the partials by their log-sum-exp. Nothing reads a device
value on the host and the grid depends only on host ints (the rows, the sequences), so any step captures
into a CUDA graph.

A prefill step's tiles are numbered across its sequences (`prefill_tiles`): sequence s owns tiles
[q_start(s) // BLOCK_Q + s, q_start(s + 1) // BLOCK_Q + s + 1), which cover its rows, and a program finds
its sequence by a binary search of `query_start_loc`. A grid of sequences x tiles of the longest chunk
would be mostly empty programs in a step of many short chunks: a prefill graph's step is sized for its
bucket (128 sequence slots and a 512-row chunk: 2,048 programs a KV head where 144 suffice). Runs on the CPU
too under TRITON_INTERPRET=1, which is how the unit tests check it. The attention backend that calls them is
`engine/attention/cuda.py`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl


class PagedMetadata(Protocol):
    """What the kernels read of a step's `AttentionMetadata` (models/layers/attention_metadata.py): its int
    tensors, on q's device, and `max_query_len`, a host int."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int


@triton.jit
def _write_kv(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = cache_ptr + slot * stride_cache_slot + heads[:, None] * stride_cache_h + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tile_sequence(query_start_loc_ptr, number, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns tile `number` of a step whose sequence s owns tiles [query_start_loc[s] // BLOCK_Q
    + s, query_start_loc[s + 1] // BLOCK_Q + s + 1): the last whose first tile is at or before it."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], num_seqs, tl.int32)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= number
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    return lo


# Unspecialized: the block table's width and the sequences vary per step; a new divisibility class would
# build mid-request.
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _paged_attention(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_h,
    stride_bt,
    page_size,
    num_seqs,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    VARLEN: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if VARLEN:  # program 0's axis: tiles numbered across the sequences (see the module's docstring)
        number = tl.program_id(0)
        seq = tile_sequence(query_start_loc_ptr, number, num_seqs, BLOCK_Q)
        tile = number - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
        split = 0
    else:
        seq = tl.program_id(0)
        tile = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # context positions before this step's tokens

    # Row r of the tile is query token tile*BLOCK_Q + r // GROUP_PAD, query head of group r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = cached + tok

    # Keys up to the tile's last token; tiles past the sequence's new tokens (and padding sequences,
    # seq_len 0) loop zero times and store zeros.
    last = tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    kv_end = tl.minimum(seq_len, cached + last) * (tile * BLOCK_Q < q_len).to(tl.int32)
    # Split-KV (decode): split s takes its share of the keys, whole blocks of BLOCK_N.
    per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = tl.minimum(split * per_split, kv_end)
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_hi
        page = tl.load(table + keys // page_size, mask=key_ok, other=0).to(tl.int64)
        slot = page * page_size + keys % page_size
        kv_offs = slot[:, None] * stride_cache_slot + kv_head * stride_cache_h + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_cache_kv + kv_offs, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials in fp32, [T, Hq, NUM_SPLITS, BLOCK_D] and their log2-sum-exp [T, Hq, NUM_SPLITS];
        # an empty split stores lse -inf and weighs nothing in the combine.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        part = ((q_start + tok).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out, mask=out_mask)


@triton.jit
def _combine_splits(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # One program per (sequence, query head) of a decode step: its one new row, if it has one.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq)
    has_row = tl.load(query_start_loc_ptr + seq + 1) > row
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    part = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=has_row, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(
        part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=has_row & (w[:, None] > 0.0), other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_offs = row.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=has_row & (dims < HEAD_DIM))


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v `[T, Hkv, D]` at `slot_mapping` in `kv_cache` `[2, pages, page_size, Hkv, D]`; -1 skips."""
    num_rows, num_kv_heads, head_dim = k.shape
    if num_rows == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _write_kv[(num_rows,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # TRITON_INTERPRET on the CPU: a few splits, so tests cover the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """KV splits per decode program: enough programs for two waves over the SMs, at most 16.

    Depends only on the batch shape, so every replay of a captured bucket uses the same split.
    """
    programs = num_seqs * num_kv_heads
    return min(16, triton.next_power_of_2(max(1, -(-2 * _num_sms(device) // programs))))


@dataclass(frozen=True)
class Tiles:
    """A prefill program's shape: its tile's rows of (token, query head) pairs, the keys it takes at a time,
    and Triton's warps and software-pipeline stages (None: Triton's default). `benchmarks/prefill_attention.py
    --sweep` times the candidates on a GPU."""

    rows: int = 64
    keys: int = 64
    warps: int = 4
    stages: int | None = None


PREFILL_TILES = Tiles()


def prefill_tiles(num_rows: int, num_seqs: int, block_q: int) -> int:
    """Programs a KV head in a prefill step of `num_rows` rows (padding rows included) and `num_seqs`
    sequences, `block_q` query tokens a tile: enough for every sequence's tiles as `_paged_attention` numbers
    them; the programs past a step's last tile find no rows."""
    return num_rows // block_q + num_seqs


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: Tiles = PREFILL_TILES,
    varlen: bool = False,
) -> torch.Tensor:
    """Causal attention of q `[T, Hq, D]` over each sequence's pages; rows of no sequence stay zero.

    Decode steps (max_query_len 1) split each sequence's keys `num_splits` ways (default
    `decode_splits`) and combine the partials in a second kernel; prefill runs one pass per query tile of
    `tiles`' shape, as does a decode step with `varlen`.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    num_seqs = meta.seq_lens.shape[0]
    decode = meta.max_query_len == 1 and not varlen
    if out is None:
        # A decode step's rows are its sequences' (a graph's padding rows are padding sequences'), and the
        # kernels write every one of them; a padded prefill chunk has rows of no sequence, which stay zero.
        covered = decode and num_rows == num_seqs
        out = torch.empty_like(q) if covered else torch.zeros_like(q)
    if num_rows == 0 or num_seqs == 0 or meta.max_query_len == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, q.device) if decode else 1
    if num_splits > 1 and not decode:
        raise ValueError("split-KV is for decode steps (max_query_len 1)")
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(num_rows, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    # tl.dot needs 16 rows: decode tiles are 16 rows of (token, head) pairs, prefill tiles `tiles.rows`.
    block_q = max(1, (16 if decode else tiles.rows) // group_pad)
    launch: dict[str, int] = {}
    if decode:
        grid = (num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, block_q) * num_splits)
    else:
        grid = (prefill_tiles(num_rows, num_seqs, block_q), num_kv_heads, 1)
        launch["num_warps"] = tiles.warps
        if tiles.stages is not None:
            launch["num_stages"] = tiles.stages
    _paged_attention[grid](
        q,
        kv_cache,
        out,
        part_out,
        part_lse,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        kv_cache.shape[2],
        num_seqs,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=64 if decode else tiles.keys,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        VARLEN=not decode,
        **launch,
    )
    if num_splits > 1:
        _combine_splits[(num_seqs, num_heads)](
            out,
            part_out,
            part_lse,
            meta.query_start_loc,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
        )
    return out
