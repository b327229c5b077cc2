"""Qwen3-ASR's language model: a dense Qwen3 decoder over a flat, ragged batch with paged KV.

The same interface as the Qwen3-Omni Thinker (`forward(input_ids, positions [3, T], kv_caches, meta,
inputs_embeds)`, `compute_logits`), so the engine runs it as it runs the Thinker. Audio tokens arrive as
`inputs_embeds` rows at the `<|audio_pad|>` placeholders. Positions are consecutive and equal on all three
M-RoPE streams for an audio-and-text prompt, which makes the released M-RoPE plain RoPE (transformers'
-hf conversion drops the M-RoPE fields for that reason): one rotary section holding every frequency.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from omnistage.models.layers.attention import Attention
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.linear import fuse_projections
from omnistage.models.layers.moe import GatedMLP
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding
from omnistage.models.loader import load_module
from omnistage.models.qwen3_asr.config import DenseTextConfig, Qwen3ASRConfig

# Where each layout keeps the decoder body and the output head.
PREFIXES = {
    "released": ("thinker.model.", "thinker.lm_head."),
    "hf": ("model.language_model.", "lm_head."),
}


class DenseDecoderLayer(nn.Module):
    """Pre-norm attention (q/k norm, RoPE, GQA) then a SwiGLU MLP.

    The MLP's residual add is left to the next layer (or the final norm): a layer returns the MLP's output and
    the residual apart, and adds the previous layer's pair before its input norm. The sum is the same bf16 add;
    compiled, it fuses into the input norm's kernel. Done at the end of the layer instead, Inductor folds it into
    the down projection as `addmm(residual, ...)`, which on a GPU first copies the residual into the output (a
    device-to-device memcpy a layer) and then accumulates onto it. The first layer gets a zero residual, not
    None: every layer then calls the compiled code with the same argument types, and none doubles its variants
    (a None on one layer took dynamo past its recompile limit, and the layers ran eagerly).
    """

    def __init__(self, cfg: DenseTextConfig, backend: AttentionBackend) -> None:
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
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual) of the layer whose input is `residual + x`; their sum is the layer's output."""
        x = residual + x
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm(x)), x


class DecoderModel(nn.Module):
    def __init__(self, cfg: DenseTextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, (cfg.head_dim // 2, 0, 0))

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        residual = torch.zeros_like(hidden)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        return self.norm(residual + hidden)


class Qwen3ASRDecoder(nn.Module):
    def __init__(self, cfg: DenseTextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states `[T, H]` of the flat batch `input_ids` `[T]` at positions `[3, T]`.

        `inputs_embeds` `[T, H]` replaces the token embeddings (audio rows already merged in). The Thinker's
        interface, which an LLM stage calls: this decoder reads no images (`deepstack_embeds`) and feeds no later
        stage (`tap_layer`).
        """
        if deepstack_embeds is not None or tap_layer is not None:
            raise ValueError("the Qwen3-ASR decoder has no deepstack levels and no hidden-state taps")
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(hidden, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight


def load_decoder(
    checkpoint_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    load_format: str = "safetensors",
    seed: int = 0,
) -> Qwen3ASRDecoder:
    """The decoder of a Qwen3-ASR checkpoint directory (either layout).

    With tied embeddings the head is the embedding table, as transformers ties them: a head tensor in the
    file (the released files carry one, equal to the table) is not read. `load_format="dummy"` reads only
    config.json and fills random weights on `device` (benchmarks).
    """
    cfg = Qwen3ASRConfig.from_dir(checkpoint_dir)
    body, head = PREFIXES[cfg.layout]
    with torch.device("meta"):
        decoder = Qwen3ASRDecoder(cfg.text, backend)
    parts = [(decoder.model, body)] + ([] if cfg.text.tie_word_embeddings else [(decoder.lm_head, head)])
    for module, prefix in parts:
        load_module(
            module, checkpoint_dir, prefix, dtype=dtype, device=device, load_format=load_format, seed=seed
        )
    if cfg.text.tie_word_embeddings:
        decoder.tie_weights()
    decoder.requires_grad_(False).eval()
    fuse_projections(decoder)
    return decoder
