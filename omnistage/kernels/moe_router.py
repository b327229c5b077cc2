"""`SparseMoeBlock.route` on CUDA: softmax, top k and renormalisation of router logits in one Triton kernel.

In torch routing is four or five kernels (softmax, torch.topk's radix selection, sum, divide, cast) of a few
µs each at decode sizes, and a speaking step runs 68 MoE layers: its time is launches. Here a program loads
a row of logits (float32 or bf16), takes their float32 softmax, selects the top k by `tl.topk` over int64
keys, the logit's bits in the float's order above the complement of the expert id, renormalises them if
asked and writes their weights (in `out_dtype`) and ids (int64), in descending order of weight.

The keys select on the logits, not on the probabilities: the softmax is monotone, so the set is the same,
and it does not hang on how exp rounds. Equal logits go to the lower expert id, a deterministic rule where
torch.topk's choice is unspecified; either way the tied weights are equal, so the experts' sum is too.

A custom op (`torch.library.triton_op`): a region compiled with dynamic shapes keeps it as one kernel,
which a CUDA graph then captures. GPU only: a CPU install may have no Triton and takes the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

_LOWEST_KEY = -(2**63)  # columns past the experts: below every real key, so never in the top k
# One row a program, in two warps: the quickest at decode sizes of the variants tried on an H200 (one warp;
# blocks of 2-8 rows). Its effect on a speaking step is in benchmarks/RESULTS.md (the speech profile at ef1cb7f).
ROWS, NUM_WARPS = 1, 2


@triton.jit
def _float_order(bits):
    """A float's int32 bits <-> an int32 in the float's order (an involution: the sign bit is kept)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# Unspecialized: the count varies per step; a new divisibility class would build mid-request.
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride, top_k, LOWEST_KEY: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, E_BLOCK)
    real = rows < num_tokens
    is_expert = (cols < num_experts)[None, :]
    ptrs = logits_ptr + rows[:, None] * stride + cols[None, :]
    logits = tl.load(ptrs, mask=real[:, None] & is_expert, other=0.0).to(tl.float32)
    # columns past the experts weigh nothing; -0.0 ties with 0.0, as their probabilities do
    logits = tl.where(is_expert, tl.where(logits == 0.0, 0.0, logits), float("-inf"))
    peak = tl.max(logits, axis=1, keep_dims=True)
    total = tl.sum(tl.exp(logits - peak), axis=1, keep_dims=True)

    ordered = _float_order(logits.to(tl.int32, bitcast=True)).to(tl.int64)
    keys = tl.where(is_expert, (ordered << 32) | (num_experts - 1 - cols).to(tl.int64)[None, :], LOWEST_KEY)
    top = tl.topk(keys, K_BLOCK)  # descending along each row
    ranks = tl.arange(0, K_BLOCK)
    in_top = (ranks < top_k)[None, :]
    ids = num_experts - 1 - (top & 0xFFFFFFFF)
    top_logits = _float_order((top >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    # the softmax's own exp of the same differences; divisions round to nearest, as torch's (`/` does not)
    weights = tl.math.div_rn(tl.exp(top_logits - peak), total)
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(tl.where(in_top, weights, 0.0), axis=1, keep_dims=True))

    out = rows[:, None] * top_k + ranks[None, :]
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=real[:, None] & in_top)
    tl.store(ids_ptr + out, ids, mask=real[:, None] & in_top)


@triton_op("omnistage::route_topk", mutates_args=())
def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `top_k` experts of each row of router `logits` `[T, E]` (float32 or bf16, unit column stride):
    their softmax weights, divided by their sum if `renormalize`, as `out_dtype` `[T, k]`, and ids `[T, k]`
    (int64)."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts or logits.stride(1) != 1:
        raise ValueError(
            f"top {top_k} of {num_experts} experts, strides {logits.stride()}: unit column stride"
        )
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    k_block = max(2, triton.next_power_of_2(top_k))  # tl.topk takes k >= 2
    wrap_triton(_route_kernel)[(triton.cdiv(num_tokens, ROWS),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0), top_k, LOWEST_KEY=_LOWEST_KEY,
        RENORMALIZE=renormalize, ROWS=ROWS, E_BLOCK=max(k_block, triton.next_power_of_2(num_experts)),
        K_BLOCK=k_block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return weights, ids
