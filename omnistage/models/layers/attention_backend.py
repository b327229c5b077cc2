"""The one attention interface every model calls."""

from __future__ import annotations

from typing import Protocol

import torch

from omnistage.models.layers.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v `[T, Hkv, D]` into `kv_cache` at `meta.slot_mapping`, then attend.

        Each new token of q `[T, Hq, D]` attends causally over its sequence's whole context (cached and
        new), read back from the pages; Hq is a multiple of Hkv (GQA). Returns `[T, Hq, D]`; padding rows
        (slot -1, or rows of a sequence whose seq_len is 0) are zeros.
        """
        ...
