"""Routed experts in two Triton kernels over expert-aligned blocks of token-expert pairs.

`moe_align.align_pairs` lays the pairs out in blocks of BLOCK_M rows, one expert per block.
`_gate_up_kernel`: one program per (block, tile of the expert width I) gathers its pairs' rows of x by
token, multiplies them by the expert's gate and up rows of w13 and writes SiLU(gate)·up, so the [2I]
intermediate never reaches memory. `_down_kernel`: one program per (block, tile of H) multiplies those
rows by w2, scales each by its routing weight and writes it to the pair's own row (input dtype); a torch
sum over each token's k rows (fp32 accumulation, no atomics) gives a deterministic result.

Shapes depend only on T, so a decode step captures into a CUDA graph; unused blocks (the static bound
is above the real count) exit at once. Decode reads each active expert's weights once per block, so
the kernels are memory bound: tiles are narrow in N so a batch of one still has hundreds of programs
for the 132 SMs, and weights are read along K, their contiguous axis. Prefill chunks run here too, on taller
tiles: the gather fused into the gate-up kernel and SiLU·up into its epilogue spare the copies around
`torch._grouped_mm` (its GEMMs alone were half the grouped path's time at 2,048 tokens). Same function as
`models/layers/moe_experts.fused_experts`; runs on the CPU under TRITON_INTERPRET=1 (float32/float16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from omnistage.kernels.moe_align import ExpertAlignment, align_pairs
from omnistage.kernels.moe_bounds import TALL_TILES_FROM, TILE_SWITCHES


@dataclass(frozen=True)
class MoeKernelConfig:
    """Tile shapes of both kernels (N tiles I in the gate-up kernel and H in the down kernel), and the order of
    their programs: `n_inner` launches a block's N tiles side by side, so that its rows (gathered by token in
    the gate-up kernel) come from memory once and from L2 for its other tiles; otherwise the blocks side by side,
    each N tile of the weights shared by the blocks next to it and each block's rows read once per N tile."""

    block_m: int
    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int = 4
    num_stages: int = 4
    n_inner: bool = False


def default_config(num_pairs: int, num_experts: int) -> MoeKernelConfig:
    """Tiles for `num_pairs` token-expert pairs spread over `num_experts` (`moe_bounds` says where they switch).

    Decode (a few pairs per expert): 16-row blocks, the smallest tensor-core tile, and narrow N tiles
    so that a batch of one (8 blocks) still runs 8·768/32 = 192 and 8·2048/64 = 256 programs. Larger
    batches fill blocks further, so taller and wider tiles reuse each weight tile for more rows; a prefill
    chunk's hundreds of rows an expert take 128-row blocks, the down kernel 256 columns of H at once.
    """
    per_expert = num_pairs / num_experts
    if per_expert <= TILE_SWITCHES[0]:
        return MoeKernelConfig(block_m=16, gate_up_n=32, gate_up_k=128, down_n=64, down_k=128)
    if per_expert <= TILE_SWITCHES[1]:
        return MoeKernelConfig(block_m=32, gate_up_n=64, gate_up_k=64, down_n=64, down_k=64, num_stages=4)
    if per_expert < TALL_TILES_FROM:
        return MoeKernelConfig(
            block_m=64, gate_up_n=64, gate_up_k=64, down_n=128, down_k=64, num_warps=8, num_stages=3
        )
    return MoeKernelConfig(
        block_m=128, gate_up_n=128, gate_up_k=64, down_n=256, down_k=64, num_warps=8, num_stages=3
    )


@triton.jit
def _program(N_INNER: tl.constexpr):
    """This program's (block, N tile): the grid's first axis runs fastest, over N tiles when `N_INNER`."""
    if N_INNER:
        block, n_tile = tl.program_id(1), tl.program_id(0)
    else:
        block, n_tile = tl.program_id(0), tl.program_id(1)
    return block, n_tile


# Unspecialized: the count varies per step; a new divisibility class would build mid-request.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    hidden_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    TOP_K: tl.constexpr,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    N_INNER: tl.constexpr,
):
    block, n_tile = _program(N_INNER)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)
    real = pairs < num_pairs
    tokens = tl.where(real, pairs // TOP_K, 0).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's [N, K] rows: K contiguous, so loads are 16-byte vectors
    gate_ptrs = w13_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + INTER * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        # constant masks along K when the tiles divide H, so the loads stay 16-byte vectors
        if HIDDEN % BLOCK_K == 0:
            a_mask = real[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = ks < HIDDEN - k0
            a_mask = real[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate, input_precision=PRECISION)
        up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    # the reference rounds gate and up to the input dtype before SiLU·up
    gate = gate.to(hidden_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(hidden_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * stride_ht + cols[None, :]
    tl.store(out_ptrs, act.to(hidden_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    hidden_ptr,
    w2_ptr,
    out_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    stride_ht,
    stride_we,
    stride_wn,
    stride_op,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    N_INNER: tl.constexpr,
):
    block, n_tile = _program(N_INNER)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)
    real = pairs < num_pairs
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * stride_ht + ks[None, :]
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < INTER - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    weight = tl.load(weights_ptr + pairs, mask=real, other=0.0).to(tl.float32)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_op + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


# Kept out of torch.compile: the launch grid comes from host arithmetic.
@torch.compiler.disable
def triton_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k].

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; topk_* `[T, k]`. Returns `[T, H]`.
    `config` overrides the tiles `default_config` picks (benchmarks sweep it).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights must be contiguous along K"
    x = x.contiguous()
    config = config or default_config(num_pairs, num_experts)
    align: ExpertAlignment = align_pairs(topk_ids, num_experts, config.block_m)
    # float32 inputs (tests) multiply in full precision, not TF32 (the default, moot for 16-bit inputs)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = {
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "PRECISION": precision,
        "N_INNER": config.n_inner,
    }

    def grid(n_tiles: int) -> tuple[int, int]:
        return (n_tiles, align.num_blocks) if config.n_inner else (align.num_blocks, n_tiles)

    act = torch.empty(align.num_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[grid(triton.cdiv(inter, config.gate_up_n))](
        x,
        w13,
        act,
        align.pair_ids,
        align.block_expert,
        num_pairs,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        INTER=inter,
        HIDDEN=hidden,
        BLOCK_M=config.block_m,
        BLOCK_N=config.gate_up_n,
        BLOCK_K=config.gate_up_k,
        **launch,
    )

    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[grid(triton.cdiv(hidden, config.down_n))](
        act,
        w2,
        per_pair,
        align.pair_ids,
        align.block_expert,
        topk_weights.reshape(-1).contiguous(),
        num_pairs,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=config.block_m,
        BLOCK_N=config.down_n,
        BLOCK_K=config.down_k,
        **launch,
    )
    return per_pair.view(num_tokens, top_k, hidden).sum(1)
