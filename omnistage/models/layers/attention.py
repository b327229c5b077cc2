"""Qwen3's attention block (projections, per-head q/k RMSNorm, RoPE), over paged KV or any other attending."""

from __future__ import annotations

from typing import Protocol

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


class AttentionSizes(Protocol):
    """What a Qwen3 attention block is sized by: every decoder config of every family has these."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...


class SelfAttention(nn.Module):
    """Qwen3's attention block around whatever attends: the q/k/v projections, per-head q/k RMSNorm and RoPE
    (`heads`), then the output projection (`project_out`). A subclass attends between them: over paged KV
    through a backend (`PagedSelfAttention`), or over a static per-frame cache (the code predictor's)."""

    def __init__(self, cfg: AttentionSizes) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: FusedProjection | None = None

    def fuse_projections(self) -> None:
        """One [q; k; v] weight, one GEMM per step; the three parameters become views of it (same names,
        no extra memory), so loading and state_dict still speak the checkpoint's names."""
        self.qkv = FusedProjection(fuse_linears(self.q_proj, self.k_proj, self.v_proj))

    def heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[..., Hq, D]`, k and v `[..., Hkv, D]` of x `[..., hidden]`, q and k normalised and rotated by
        cos/sin `[T, D]` (T: x's next-to-last dim)."""
        lead = x.shape[:-1]
        if self.qkv is not None:
            qkv = self.qkv(x)
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[..., : heads * self.head_dim].reshape(*lead, heads, self.head_dim)
            q, k = norm_rotate_qk(qk, self.q_norm, self.k_norm, self.num_heads, cos, sin)
            v = qkv[..., heads * self.head_dim :].reshape(*lead, self.num_kv_heads, self.head_dim)
            return q, k, v
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(*lead, self.num_kv_heads, self.head_dim))
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attended heads `[..., Hq, D]`."""
        return self.o_proj(out.reshape(*out.shape[:-2], self.num_heads * self.head_dim))


class PagedSelfAttention(SelfAttention):
    """The decoders' attention: a flat, ragged batch `[T, hidden]` over paged KV through the attention backend."""

    def __init__(self, cfg: AttentionSizes, backend: AttentionBackend) -> None:
        super().__init__(cfg)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.heads(x, cos, sin)
        return self.project_out(self.backend.forward(q, k, v, kv_cache, meta, self.scale))
