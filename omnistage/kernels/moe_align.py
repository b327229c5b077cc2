"""Token-expert pairs grouped by expert without a sort: the shared first step of the grouped MoE paths.

Pair p = t·k + j is token t's j-th routed expert. Each expert's pairs keep their order (stable, so the
result is deterministic) and start a new run of `block_m`-row blocks; a pair's slot is its expert's
first padded row plus its rank among that expert's pairs. The number of blocks is a static bound of the
pair count, so the result has fixed shapes and a decode step with it captures into a CUDA graph.

Up to `ALIGN_KERNEL_MAX_PAIRS` (decode batches) one Triton program does it all, its ranks a cumulative sum
over the one-hot pair-by-expert matrix (one launch, no sort: `torch.sort` costs 27 µs per layer at T=32).
Past it (prefill chunks) `align_pairs_torch` sorts, where the one-hot's O(P·E) work would dominate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from omnistage.kernels.moe_bounds import ALIGN_KERNEL_MAX_PAIRS


@dataclass
class ExpertAlignment:
    """Pairs in expert order, padded per expert to whole blocks of `block_m` rows.

    pair_ids `[num_blocks·block_m]` int32: the pair in each padded row, `num_pairs` for padding rows.
    block_expert `[num_blocks]` int32: the expert of each block, -1 for the unused blocks at the end.
    expert_ends `[E]` int32: the end of each expert's padded rows (with block_m 1: the group offsets).
    """

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    expert_ends: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the blocks: at most min(E, pairs) experts get pairs, each pads by < block_m rows."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the pairs of `topk_ids` `[T, k]` by expert, each expert padded to a multiple of `block_m`."""
    flat_ids = topk_ids.reshape(-1)
    num_pairs = flat_ids.shape[0]
    if flat_ids.is_cuda and num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        return align_pairs_triton(flat_ids, num_experts, block_m)
    return align_pairs_torch(flat_ids, num_experts, block_m)


def align_pairs_torch(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """The layout from a stable sort by expert: O(P log P) work and O(P) memory, where the Triton program's
    one-hot cumulative sum is O(P·E) (a prefill chunk of 8,192 tokens has 65,536 pairs)."""
    num_pairs, device = flat_ids.shape[0], flat_ids.device
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    experts = torch.arange(num_experts, device=device, dtype=sorted_ids.dtype)
    raw_ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # [E] unpadded group ends
    counts = torch.diff(raw_ends, prepend=raw_ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0, dtype=torch.int32)
    # the i-th sorted pair is its expert's (i - raw start)-th: its row is the expert's first padded row on
    sorted_long = sorted_ids.long()
    rank = torch.arange(num_pairs, dtype=torch.int32, device=device) - (raw_ends - counts)[sorted_long]
    slots = (ends - padded)[sorted_long] + rank
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[slots.long()] = order.to(torch.int32)
    first_rows = torch.arange(num_blocks, dtype=torch.int32, device=device) * block_m
    block_expert = torch.searchsorted(ends, first_rows, right=True).to(torch.int32)
    block_expert = block_expert.masked_fill(block_expert >= num_experts, -1)
    return ExpertAlignment(pair_ids, block_expert, ends, block_m, num_pairs)


# Unspecialized: the count varies per step; a new divisibility class would build mid-request.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(
    ids_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    expert_ends_ptr,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    chunk = tl.arange(0, BLOCK_P)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + start + chunk, mask=start + chunk < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(expert_ends_ptr + experts, ends, mask=experts < NUM_EXPERTS)

    # A block's expert is the number of experts whose padded rows end at or before its first row.
    for start in range(0, num_blocks, BLOCK_P):
        blocks = start + chunk
        first_rows = blocks * BLOCK_M
        expert = tl.sum((first_rows[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        expert = tl.where(expert < NUM_EXPERTS, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    for start in range(0, num_blocks * BLOCK_M, BLOCK_P):
        rows = start + chunk
        tl.store(
            pair_ids_ptr + rows,
            tl.zeros([BLOCK_P], dtype=tl.int32) + num_pairs,
            mask=rows < num_blocks * BLOCK_M,
        )
    # the padding marks above must land before the pairs below overwrite some of them
    tl.debug_barrier()

    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        pairs = start + chunk
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        running = tl.cumsum(hit, axis=0) + seen[None, :]
        slot = tl.sum(hit * (starts[None, :] + running - 1), axis=1)
        tl.store(pair_ids_ptr + slot, pairs, mask=pairs < num_pairs)
        seen += tl.sum(hit, axis=0)


def align_pairs_triton(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    num_pairs, device = flat_ids.shape[0], flat_ids.device
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    expert_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    # [BLOCK_P, E_PAD] int32 tiles of 4096 values: 32 registers a thread at 4 warps
    block_p = min(128, max(16, 4096 // e_pad))
    _align_kernel[(1,)](
        flat_ids,
        pair_ids,
        block_expert,
        expert_ends,
        num_pairs,
        num_blocks,
        NUM_EXPERTS=num_experts,
        E_PAD=e_pad,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        num_warps=4,
    )
    return ExpertAlignment(pair_ids, block_expert, expert_ends, block_m, num_pairs)
