"""Routed experts through `torch._grouped_mm`: two grouped GEMMs over the token-expert pairs sorted by
expert, with no host sync and static shapes (T·k rows), so a decode step with it can be captured in a
CUDA graph. Same function as `moe_experts.fused_experts`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k].

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; topk_* `[T, k]`. Returns `[T, H]`.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w2.shape[0], w2.shape[-1]
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    # End offset of each expert's rows in the sorted order; searchsorted keeps it on the device
    # (bincount would sync with the host and break graph capture).
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)

    x_sorted = x.index_select(0, order // top_k)  # [T·k, H]
    gate_up = torch._grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offsets)  # [T·k, 2I]
    hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)  # [T·k, H]

    # Back to (token, slot) order, then a weighted sum over the k slots: a batched GEMV that accumulates
    # in fp32 on the GPU and needs no atomics, so the result is deterministic.
    unsorted = torch.empty_like(down)
    unsorted[order] = down
    weights = topk_weights.to(x.dtype).view(num_tokens, 1, top_k)
    return torch.bmm(weights, unsorted.view(num_tokens, top_k, -1)).view(num_tokens, -1)
