"""The attention call site of a Qwen3 decoder layer: projections, per-head q/k RMSNorm, M-RoPE, backend."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.linear import FusedProjection, fuse_linears
from omnistage.models.layers.norm import RMSNorm, rms_norm
from omnistage.models.layers.rotary import apply_rotary


def norm_rotate_qk(
    qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[..., Hq, D]` and k `[..., Hkv, D]` from their heads side by side before the norm `[..., Hq + Hkv, D]`
    (as the fused q/k/v GEMM lays them out): the per-head RMSNorm, each head with its norm's weight, then RoPE,
    in one pass over all heads. The arithmetic of every head is the same as normalising and rotating q and k
    apart; compiled, it is one kernel a layer instead of one for q and one for k."""
    if q_norm.eps != k_norm.eps:
        raise ValueError(f"q_norm eps {q_norm.eps} differs from k_norm eps {k_norm.eps}")
    kv_heads = qk.shape[-2] - num_heads
    weight = torch.cat((q_norm.weight.expand(num_heads, -1), k_norm.weight.expand(kv_heads, -1)))
    q, k = apply_rotary(rms_norm(qk, weight, q_norm.eps), cos, sin).split([num_heads, kv_heads], dim=-2)
    return q, k


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        self.qkv: FusedProjection | None = None

    def fuse_projections(self) -> None:
        """One [q; k; v] weight, one GEMM per step; the three parameters become views of it (same names,
        no extra memory), so loading and state_dict still speak the checkpoint's names."""
        self.qkv = FusedProjection(fuse_linears(self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(x)
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, : heads * self.head_dim].reshape(tokens, heads, self.head_dim)
            q, k = norm_rotate_qk(qk, self.q_norm, self.k_norm, self.num_heads, cos, sin)
            v = qkv[:, heads * self.head_dim :].reshape(tokens, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
            v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
