import pytest
import torch

from omnistage.models.layers.grouped_moe import grouped_experts
from omnistage.models.layers.moe_experts import fused_experts


def _inputs(num_tokens, hidden, inter, experts, top_k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    probs = torch.randn(num_tokens, experts, generator=g).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("top_k", [1, 4])
def test_matches_loop_float32(num_tokens, top_k):
    args = _inputs(num_tokens, 64, 32, 16, top_k, torch.float32, seed=num_tokens * 10 + top_k)
    out = grouped_experts(*args)
    assert out.shape == (num_tokens, 64) and out.dtype == torch.float32
    assert _rel(out, fused_experts(*args)) < 1e-5


def test_matches_loop_bf16():
    args = _inputs(48, 128, 64, 8, 4, torch.bfloat16, seed=3)
    out = grouped_experts(*args)
    assert out.dtype == torch.bfloat16
    assert _rel(out, fused_experts(*args)) < 2e-2


def test_unused_experts_and_one_hot_routing():
    # Every token to expert 2 only: all other groups are empty.
    x, w13, w2, _, _ = _inputs(7, 32, 16, 4, 1, torch.float32, seed=5)
    ids = torch.full((7, 2), 2)
    ids[:, 1] = 3
    weights = torch.tensor([[0.25, 0.75]]).expand(7, 2).contiguous()
    assert _rel(grouped_experts(x, w13, w2, weights, ids), fused_experts(x, w13, w2, weights, ids)) < 1e-5
