"""The decoder the Thinker and the Talker share: Qwen3 MoE layers, sized by each one's config."""

from __future__ import annotations

from omnistage.models.layers.attention import PagedSelfAttention
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.decoder import DecoderLayer
from omnistage.models.layers.moe import SparseMoeBlock
from omnistage.models.qwen3_omni.config import TextConfig


def moe_decoder_layer(cfg: TextConfig, backend: AttentionBackend) -> DecoderLayer:
    """Pre-norm attention (q/k norm, M-RoPE) then the routed experts, with a gated shared expert where the
    config sizes one (the Talker's)."""
    experts = SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.norm_topk_prob,
        cfg.shared_expert_intermediate_size,
    )
    return DecoderLayer(cfg, PagedSelfAttention(cfg, backend), experts)
