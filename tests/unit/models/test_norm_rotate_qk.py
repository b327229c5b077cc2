"""q/k RMSNorm and RoPE over all heads in one pass equal the two apart, bit for bit."""

import pytest
import torch

from omnistage.models.layers.attention import norm_rotate_qk
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(5,), (3, 4)])  # a Thinker step's rows; a code-predictor batch x positions
def test_joint_heads_equal_q_and_k_apart(dtype, lead):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim, generator=g))
        k_norm.weight.copy_(torch.randn(dim, generator=g))
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    qk = (torch.randn(*lead, heads + kv_heads, dim, generator=g) * 3).to(dtype)
    positions = torch.arange(lead[-1]).expand(3, -1) + 7
    cos, sin = MRotaryEmbedding(dim, 10000.0, (dim // 2, 0, 0))(positions)
    with torch.no_grad():
        q, k = norm_rotate_qk(qk, q_norm, k_norm, heads, cos, sin)
        want_q = apply_rotary(q_norm(qk[..., :heads, :]), cos, sin)
        want_k = apply_rotary(k_norm(qk[..., heads:, :]), cos, sin)
    assert q.shape == (*lead, heads, dim) and k.shape == (*lead, kv_heads, dim)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_norms_of_different_eps_are_refused():
    qk = torch.zeros(1, 3, 4)
    cos = sin = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="eps"):
        norm_rotate_qk(qk, RMSNorm(4, 1e-6), RMSNorm(4, 1e-5), 2, cos, sin)
