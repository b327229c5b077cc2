"""The decoder every family stacks: pre-norm layers of self-attention and a pluggable MLP, a final norm, RoPE.

The Thinker and the Talker put routed experts in the MLP's place, Qwen3-ASR's decoder and the code predictor a
SwiGLU; the attention is the paged one (`PagedSelfAttention`) or the code predictor's static per-frame cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from omnistage.models.layers.attention import AttentionSizes
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm self-attention then the MLP, each added to the residual stream.

    The MLP's residual add is left to the next layer (or the final norm): a layer returns the MLP's output and
    the residual apart, and adds the previous layer's pair before its input norm. The sum is the same bf16 add;
    compiled, it fuses into the input norm's kernel. Done at the end of the layer instead, Inductor folds it into
    a dense MLP's down projection as `addmm(residual, ...)`, which on a GPU first copies the residual into the
    output (a device-to-device memcpy a layer) and then accumulates onto it. The first layer gets a zero
    residual, not None: every layer then calls the compiled code with the same argument types, and none doubles
    its variants (a None on one layer took dynamo past its recompile limit, and the layers ran eagerly).
    """

    def __init__(self, cfg: AttentionSizes, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *cache: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual) of the layer whose input is `residual + x`; their sum is the layer's output.
        `cache`: where the attention keeps K/V (a paged cache and the step's metadata, or a frame's cache)."""
        x = residual + x
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, *cache)
        return self.mlp(self.post_attention_layernorm(x)), x


class DecoderSizes(AttentionSizes, Protocol):
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...


class Decoder(nn.Module):
    """`layers` (built by `make_layer`), the final `norm` and `rotary_emb`; a subclass adds its embedding table.
    `mrope_section` `(head_dim / 2, 0, 0)` is plain RoPE."""

    def __init__(
        self,
        cfg: DecoderSizes,
        make_layer: Callable[[], DecoderLayer],
        mrope_section: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make_layer() for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope_section)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-norm hidden states `[T, H]` of the rows `hidden` `[T, H]` at M-RoPE `positions` `[3, T]`, each
        layer over its paged cache; `deepstack_embeds` and `tap_layer` as `run` takes them. With `tap_layer`,
        returns also the tapped hidden states."""
        cos, sin = self.rotary_emb(positions)
        caches = [(kv_cache, meta) for kv_cache in kv_caches]
        hidden, tapped = self.run(hidden, cos, sin, caches, deepstack_embeds, tap_layer)
        return hidden if tap_layer is None else (hidden, cast(torch.Tensor, tapped))

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[tuple[object, ...]],
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-norm hidden states of `hidden` through the layers, layer i attending over `caches[i]`, and
        the output of the first `tap_layer` layers, as transformers records hidden states (before that layer's
        deepstack addition; after the final norm when it is the last layer), or None without a tap.
        `deepstack_embeds[i]` `[T, H]` is added to the output of layer i."""
        residual = torch.zeros_like(hidden)
        tapped = None
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            hidden, residual = layer(hidden, residual, cos, sin, *cache)
            if i + 1 == tap_layer:
                tapped = residual + hidden
            if deepstack_embeds is not None and i < len(deepstack_embeds):
                # the layer's output plus the level, as one row again: the next layer adds a zero MLP output
                residual, hidden = residual + hidden + deepstack_embeds[i], torch.zeros_like(hidden)
        hidden = self.norm(residual + hidden)
        return hidden, hidden if tap_layer == len(self.layers) else tapped


class TextDecoderSizes(DecoderSizes, Protocol):
    @property
    def vocab_size(self) -> int: ...


class TextDecoder(Decoder):
    """A decoder over token ids: `embed_tokens` ahead of the layers."""

    def __init__(
        self, cfg: TextDecoderSizes, make_layer: Callable[[], DecoderLayer], mrope_section: tuple[int, ...]
    ) -> None:
        super().__init__(cfg, make_layer, mrope_section)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class CausalLM(nn.Module):
    """A text decoder (`model`) and its `lm_head`: the interface an LLM stage runs (the Thinker, Qwen3-ASR's)."""

    def __init__(self, cfg: TextDecoderSizes, model: TextDecoder) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-norm hidden states `[T, H]` of the flat batch `input_ids` `[T]` at M-RoPE `positions` `[3, T]`.

        `inputs_embeds` `[T, H]` replaces the token embeddings (audio/image features already merged in);
        `deepstack_embeds` and `tap_layer` as `Decoder.forward` takes them (the speech hand-off reads the tap).
        """
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(hidden, positions, kv_caches, meta, deepstack_embeds, tap_layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
