"""The one attention interface every model calls."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from omnistage.models.layers.attention_metadata import AttentionMetadata


class AttentionBackend(ABC):
    """A step's attention over the paged KV cache: its new K/V written to their pages, then read back.
    Backends differ only in how each half runs."""

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
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def scratch_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The most a step's attention holds beyond its inputs and output, for layers of `kv_heads` K/V heads of
        `head_dim` in `dtype`: what a memory floor measured at no cached context would not see."""
        return 0

    def warm_up(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Build, at start, what a step of layers of this layout may build at run time (a kernel a long prompt's
        first chunk would otherwise build while serving); nothing by default."""
        return None

    @abstractmethod
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store each row's k/v at its flat slot; rows with slot -1 are skipped."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q's attention over the pages, the step's own K/V already written there."""
