"""The decoder layer the Thinker and the Talker share: the same Qwen3 MoE layer, sized by each one's config."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.models.layers.attention import Attention
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.moe import SparseMoeBlock
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.qwen3_omni.config import TextConfig


class MoeDecoderLayer(nn.Module):
    """Pre-norm attention (q/k norm, M-RoPE) then the routed experts, with a gated shared expert where the
    config sizes one (the Talker's)."""

    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            backend,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))
