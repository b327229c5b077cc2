"""Sparse mixture-of-experts MLP: softmax router, top-k, stacked experts, optional gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.moe_bounds import ALIGN_KERNEL_MAX_PAIRS, TALL_TILES_FROM, TILE_SWITCHES
from omnistage.models.layers.linear import FusedProjection, fuse_linears
from omnistage.models.layers.moe_experts import fused_experts


def kernel_switches(num_experts: int, top_k: int) -> tuple[int, ...]:
    """The largest token counts of each GPU path but the last: each of the Triton experts' tile classes but the
    tallest, and the alignment kernel's (above it, the torch alignment). A compiled layer keeps a variant per
    path and Triton builds each tile class once, so a warm-up that runs each count and the next builds them all
    before serving."""
    tiles = [bound * num_experts // top_k for bound in TILE_SWITCHES]
    tiles.append(-(-TALL_TILES_FROM * num_experts // top_k) - 1)
    return (*tiles, ALIGN_KERNEL_MAX_PAIRS // top_k)


def route_torch(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert weights (`dtype`) and ids `[T, k]` from a float32 softmax over router `logits` `[T, E]`,
    divided by their sum if `renormalize`: the CPU's routing and the oracle of
    `kernels.moe_router.route_topk`."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=False)  # order is irrelevant to the sum
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class GatedMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)); the Talker's shared expert and dense decoders' MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: FusedProjection | None = None

    def fuse_projections(self) -> None:
        """gate and up as one GEMM (`linear.fuse_linears`)."""
        self.gate_up = FusedProjection(fuse_linears(self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class StackedExperts(nn.Module):
    """All experts' weights in two tensors, as grouped GEMMs want them.

    The checkpoint's `experts.E.{gate,up}_proj.weight` are rows `[:I]` and `[I:]` of `w13[E]`;
    `experts.E.down_proj.weight` is `w2[E]`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool = True,
        shared_expert_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.kernel = "auto"
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert: GatedMLP | None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def _experts(self, x: torch.Tensor):
        """On the GPU in bf16 the graph-safe kernels (`kernel`: auto and triton the Triton one at every size,
        grouped_mm torch's grouped GEMMs); else the exact loop.

        The GPU kernels are imported here, where they run: they need Triton, which a CPU install may lack.
        """
        if not (x.is_cuda and x.dtype == torch.bfloat16):
            return fused_experts
        if self.kernel == "grouped_mm":
            from omnistage.models.layers.grouped_moe import grouped_experts

            return grouped_experts
        from omnistage.kernels.moe import triton_experts

        return triton_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert weights (x's dtype) and ids `[T, k]` from a float32 softmax over the router logits.

        On the GPU one Triton kernel (`kernels.moe_router`) instead of torch's four or five, imported here for
        the reason `_experts` gives.
        """
        logits = self.gate(x)
        if x.is_cuda:
            from omnistage.kernels.moe_router import route_topk

            return route_topk(logits, self.top_k, self.norm_topk_prob, x.dtype)
        return route_torch(logits, self.top_k, self.norm_topk_prob, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self._experts(x)(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
