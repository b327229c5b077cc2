"""The Thinker's language model: a Qwen3 MoE decoder over a flat, ragged batch with paged KV.

Parameter names equal the checkpoint's minus `thinker.` (experts stacked, see `models/loader.py`).
Audio and vision towers live in their own modules; their features arrive as `inputs_embeds` and, for
vision, as `deepstack_embeds`.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from torch import nn

from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.linear import fuse_projections
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding
from omnistage.models.loader import load_module
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig, TextConfig
from omnistage.models.qwen3_omni.moe_decoder import MoeDecoderLayer


class ThinkerTextModel(nn.Module):
    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(positions)
        tapped = None
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_caches[i], meta)
            if i + 1 == tap_layer:
                tapped = hidden
            if deepstack_embeds is not None and i < len(deepstack_embeds):
                hidden = hidden + deepstack_embeds[i]
        hidden = self.norm(hidden)
        if tap_layer is None:
            return hidden
        # tap_layer is one of the layers (1..len), so the loop set `tapped` before the last
        return hidden, hidden if tap_layer == len(self.layers) else cast(torch.Tensor, tapped)


class Thinker(nn.Module):
    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = ThinkerTextModel(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def from_config(cls, cfg: TextConfig, backend: AttentionBackend) -> Thinker:
        return cls(cfg, backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-norm hidden states `[T, H]` of the flat batch `input_ids` `[T]` at M-RoPE `positions` `[3, T]`.

        `inputs_embeds` `[T, H]` replaces the token embeddings (audio/image features already merged in);
        `deepstack_embeds[i]` `[T, H]` is added after decoder layer i (zeros away from visual tokens).
        With `tap_layer`, returns also the hidden states after that many layers, as transformers records them
        (before that layer's deepstack addition; after the final norm when it is the last layer): the speech
        hand-off reads them.
        """
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(hidden, positions, kv_caches, meta, deepstack_embeds, tap_layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def load_thinker(
    checkpoint_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    load_format: str = "safetensors",
    seed: int = 0,
) -> Thinker:
    """The Thinker's language model from a Qwen3-Omni checkpoint directory (`thinker.model.*`, `thinker.lm_head.*`).

    `load_format="dummy"` reads only config.json and fills random weights on `device` (benchmarks).
    """
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).thinker.text
    with torch.device("meta"):
        thinker = Thinker.from_config(cfg, backend)
    # two prefixes, because `thinker.` also holds the audio and vision towers
    for module, prefix in ((thinker.model, "thinker.model."), (thinker.lm_head, "thinker.lm_head.")):
        load_module(
            module, checkpoint_dir, prefix, dtype=dtype, device=device, load_format=load_format, seed=seed
        )
    thinker.requires_grad_(False).eval()
    fuse_projections(thinker.model)
    return thinker
