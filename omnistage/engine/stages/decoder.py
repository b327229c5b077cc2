"""What an autoregressive stage needs of its model, whatever the family: the decoder's sizes, the decoder over
token ids, the decoder over fed rows, and the processor whose tokenizer detokenizes the outputs.

Structural types: a family's classes (models/qwen3_omni, models/qwen3_asr) fit them without naming the engine,
and the engine names no family.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from tokenizers import Tokenizer

from omnistage.models.layers.attention import PagedSelfAttention
from omnistage.models.layers.attention_metadata import AttentionMetadata


class DecoderSizes(Protocol):
    """A decoder's config as a stage reads it: its KV pages' shape, its rows, its vocabulary and its context."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...


def moe_routing(sizes: DecoderSizes) -> tuple[int, int] | None:
    """A MoE decoder's experts and the experts it routes each token to; None for a dense decoder, whose config
    has no such keys."""
    top_k = getattr(sizes, "num_experts_per_tok", None)
    return None if top_k is None else (sizes.num_experts, top_k)  # type: ignore[attr-defined]


def warm_attention(decoder: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Each attention backend of `decoder`'s layers warmed once per head layout (`AttentionBackend.warm_up`)."""
    seen: set[tuple[int, int, int, int]] = set()
    for module in decoder.modules():
        if isinstance(module, PagedSelfAttention):
            layout = (id(module.backend), module.num_heads, module.num_kv_heads, module.head_dim)
            if layout not in seen:
                seen.add(layout)
                module.backend.warm_up(*layout[1:], dtype, device)


class DecoderBody(Protocol):
    """The layers of a decoder and its token embedding."""

    @property
    def embed_tokens(self) -> torch.nn.Embedding: ...

    @property
    def layers(self) -> torch.nn.ModuleList: ...


class TokenDecoder(Protocol):
    """A decoder over token ids (the Thinker, Qwen3-ASR's decoder): final-norm hidden states of a flat batch
    over paged KV (encoder rows in place of some embeddings, deepstack levels, a tapped layer's states beside),
    and the logits of hidden states."""

    @property
    def model(self) -> DecoderBody: ...

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
        tap_layer: int | None = None,
    ) -> Any: ...  # the hidden states `[T, H]`, or with `tap_layer` the pair (hidden, tapped)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


class RowDecoder(Protocol):
    """A decoder over fed embedding rows (the Talker): final hidden states, and the logits of hidden states."""

    def __call__(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def torch_module(decoder: TokenDecoder | RowDecoder) -> torch.nn.Module:
    """The decoder as the torch module it is, for what walks its modules (its weights, kernel adoption)."""
    if not isinstance(decoder, torch.nn.Module):
        raise TypeError(f"a decoder is a torch module, not {type(decoder).__name__}")
    return decoder


class StageProcessor(Protocol):
    """What a text stage reads of its family's processor: the tokenizer it detokenizes with, and the most
    audios and images a prompt may carry (its encoders' floor is measured on them)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_audios(self) -> int: ...

    @property
    def max_images(self) -> int: ...
