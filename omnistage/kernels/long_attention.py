"""Causal attention of prompt rows over contiguous keys, in Triton: the long-prefill path's other kernel.

`engine/attention/long_prefill.py` gathers a long step's keys from their pages into one contiguous run and
calls a varlen kernel on them; torch's varlen FlashAttention ran there at 288-346 TFLOP/s on an H100, cuDNN's
at 494-572 on fresh prompts but with a plan built per shape (benchmarks/RESULTS.md, "cuDNN's attention on a
video's whole prompt"). This kernel takes the same call with no plan to build: each program owns a tile of
BLOCK_M rows of one sequence, for one query head or (`LongTiles.pack`) for the query heads of one K/V head, walks
the keys every row of the tile sees with no mask (unmasked loads, no compare per score), then the few blocks
along the causal diagonal with it, in an online softmax in base 2. Tiles are numbered across the sequences as in `attention.py` (sequence s owns tiles
[cu_q(s) // BLOCK_M + s, cu_q(s + 1) // BLOCK_M + s + 1)) and launched last first: the tiles at the end of a
chunk see the most keys. The heads sharing a K/V head are launched side by side, so their keys come from L2.

Runs on the CPU under TRITON_INTERPRET=1, which is how the unit tests check it; `tests/unit/kernels/
test_long_attention_compiles.py` builds it for sm_90 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from omnistage.kernels.attention import tile_sequence


@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def _long_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_q_ptr,
    cu_k_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    num_seqs,
    num_tiles,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    TMA: tl.constexpr,
):
    # Row r of the tile is token first + r // HEADS of query head head0 + r % HEADS: HEADS 1, one head a program,
    # or a K/V head's group packed (its size padded to a power of two; the padding rows are never stored).
    BLOCK_Q: tl.constexpr = BLOCK_M // HEADS
    head0 = tl.program_id(0) * (GROUP if HEADS > 1 else 1)
    kv_head = head0 // GROUP
    number = num_tiles - 1 - tl.program_id(1)
    seq = tile_sequence(cu_q_ptr, number, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    cached = tl.load(cu_k_ptr + seq + 1) - k_start - q_len  # the keys before the sequence's first row
    first = (number - (q_start // BLOCK_Q + seq)) * BLOCK_Q

    tokens = first + tl.arange(0, BLOCK_M) // HEADS
    heads = head0 + tl.arange(0, BLOCK_M) % HEADS
    row_ok = (tokens < q_len) & (tl.arange(0, BLOCK_M) % HEADS < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    if TMA:  # q, k and v are tensor descriptors: each block one bulk copy, the rows past the tensor zeros
        q = q_ptr.load([q_start + first, head0, 0]).reshape(BLOCK_M, HEAD_DIM)
        k_at, v_at = k_ptr, v_ptr
    else:
        q_offs = (
            (q_start + tokens).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        )
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
        k_at = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_at = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh

    # Every row of the tile sees the keys before `cached + first`; the band after them, up to the tile's last
    # row, takes the mask. A tile past the sequence's rows (its last, when they fill whole tiles) sees none.
    live = first < q_len
    seen_by_all = tl.where(live, (cached + first) // BLOCK_N * BLOCK_N, 0)
    band_end = tl.where(live, cached + tl.minimum(first + BLOCK_Q, q_len), 0)
    positions = cached + tokens

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, seen_by_all, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q, k_at, v_at, k_start + start, kv_head, start, stride_kt, stride_vt, positions, band_end,
            scale_log2, m_i, l_i, acc, BLOCK_N, HEAD_DIM, TMA, False,
        )  # fmt: skip
    # A live row has seen a key by the band's first block (the key `seen_by_all` is at or before its own), so
    # its running max is finite from then on; a padding row past the chunk's end is never stored.
    for start in range(seen_by_all, band_end, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q, k_at, v_at, k_start + start, kv_head, start, stride_kt, stride_vt, positions, band_end,
            scale_log2, m_i, l_i, acc, BLOCK_N, HEAD_DIM, TMA, True,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = (q_start + tokens).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _key_block(
    q,
    k_at,
    v_at,
    row,
    kv_head,
    start,
    stride_kt,
    stride_vt,
    positions,
    band_end,
    scale_log2,
    m_i,
    l_i,
    acc,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The online softmax over keys start..start+BLOCK_N: (running max, sum, accumulator) after them. Keys are
    at row `row` of the descriptors `k_at`, `v_at` (TMA), or at `start` from the sequence's first key's pointers.
    MASKED: the causal band's block, each row seeing the keys at or before its position and before `band_end`
    (a descriptor's block reads into the next sequence's keys, masked out of every score)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < band_end
    k = _block(k_at, row, kv_head, keys, key_ok, stride_kt, BLOCK_N, HEAD_DIM, TMA, MASKED)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        s = tl.where((keys[None, :] <= positions[:, None]) & key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = _block(v_at, row, kv_head, keys, key_ok, stride_vt, BLOCK_N, HEAD_DIM, TMA, MASKED)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _block(
    at,
    row,
    kv_head,
    keys,
    key_ok,
    stride_t,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """`[BLOCK_N, HEAD_DIM]` keys or values: a descriptor's block at `row` (TMA), or `keys` from the sequence's
    first key's pointer, those past `key_ok` zeros where MASKED."""
    if TMA:
        block = at.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        offsets = keys.to(tl.int64)[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            block = tl.load(at + offsets, mask=key_ok[:, None], other=0.0)
        else:
            block = tl.load(at + offsets)
    return block


@dataclass(frozen=True)
class LongTiles:
    """A program's rows and the keys it takes at a time, Triton's warps and pipeline stages, and whether its
    blocks come by tensor descriptors (`tma`: one bulk copy a block on a Hopper GPU, Triton's own loads
    elsewhere) rather than pointers, and whether a tile's rows are one query head's or a K/V head's group's
    (`pack`: `rows` over the group's heads, so that a sequence of a few rows, a decode row beside a long chunk,
    fills the tile with its heads rather than with padding, and each key block serves the whole group).
    `benchmarks/sdpa_long.py --triton-sweep` times the candidates on a GPU."""

    rows: int = 128
    keys: int = 64
    warps: int = 8
    stages: int = 3
    tma: bool = True
    pack: bool = False


LONG_TILES = LongTiles()


MAX_HEAD_DIM = 256  # a tile's rows of q and its accumulator stay in registers


def long_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    tiles: LongTiles = LONG_TILES,
) -> torch.Tensor:
    """Each sequence's rows of q `[T, Hq, D]` attending causally to its keys k, v `[K, Hkv, D]`, its last row
    seeing every key: sequence s has rows cu_q[s]:cu_q[s+1] and keys cu_k[s]:cu_k[s+1] (int32 `[B+1]`, on q's
    device). FlashAttention's varlen call, whose `max_q` and `max_k` it takes and does not need. Heads of a
    width other than a power of two are padded with zeros to one: the zeros add nothing to a score, and the
    output's padding is cut off."""
    del max_q, max_k
    num_rows, num_heads, head_dim = q.shape
    width = max(16, triton.next_power_of_2(head_dim))
    if width > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    if width != head_dim:
        q, k, v = (F.pad(t, (0, width - head_dim)) for t in (q, k, v))
        return long_attention(q, k, v, cu_q, cu_k, 0, 0, scale, tiles)[..., :head_dim].contiguous()
    out = torch.empty_like(q)
    num_seqs = cu_q.shape[0] - 1
    if num_rows == 0 or num_seqs == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    group = num_heads // k.shape[1]
    heads = triton.next_power_of_2(group) if tiles.pack else 1
    if tiles.rows % heads:
        raise ValueError(f"a packed tile's {tiles.rows} rows do not take whole groups of {heads} heads")
    num_tiles = num_rows // (tiles.rows // heads) + num_seqs
    blocks: tuple[torch.Tensor | TensorDescriptor, ...] = (q, k, v)
    tma = tiles.tma and all(_bulk_copyable(t) for t in blocks)
    if tma:
        boxes = ([tiles.rows // heads, heads, head_dim], [tiles.keys, 1, head_dim], [tiles.keys, 1, head_dim])
        blocks = tuple(
            TensorDescriptor(t, list(t.shape), list(t.stride()), box) for t, box in zip(blocks, boxes)
        )
    _long_attention[(num_heads // group if tiles.pack else num_heads, num_tiles)](
        *blocks,
        out,
        cu_q,
        cu_k,
        scale * 1.4426950408889634,  # log2(e): the softmax in base 2
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        num_seqs,
        num_tiles,
        GROUP=group,
        BLOCK_M=tiles.rows,
        BLOCK_N=tiles.keys,
        HEAD_DIM=head_dim,
        HEADS=heads,
        TMA=tma,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out


def _bulk_copyable(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address `t`: its start and every stride but the last 16-byte aligned."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in t.stride()[:-1])
