"""The routed-expert computation every MoE block goes through.

`fused_experts` has one signature for all implementations: this reference (a loop over the experts that
received tokens) and the grouped-GEMM GPU path that replaces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k].

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; topk_* `[T, k]`. Returns `[T, H]`.
    The loop reads which experts got tokens on the host; the GPU implementation does not.
    """
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x.index_select(0, tokens) @ w13[expert].t()
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        hidden = (hidden @ w2[expert].t()) * topk_weights[tokens, slot, None]
        # a token meets each expert at most once, so plain indexed += is exact (and, unlike index_add_,
        # cheap for small batches on multi-threaded CPUs)
        out[tokens] += hidden.to(out.dtype)
    return out
