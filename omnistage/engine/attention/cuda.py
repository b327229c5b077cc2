"""The GPU attention backend: the Triton kernels of `kernels/attention.py` behind the one interface, and torch's
FlashAttention for prompt chunks over long contexts (`long_prefill.py`).

Imported only on a CUDA device (`backend_for`): the kernels need Triton, which a CPU install may lack.
"""

from __future__ import annotations

import torch

from omnistage.engine.attention import long_prefill
from omnistage.kernels import attention as kernels
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata


class CudaAttentionBackend(AttentionBackend):
    """The GPU attention backend: Triton K/V write and paged attention, no host syncs.

    Expects `kv_cache` `[2, num_pages, page_size, Hkv, D]` contiguous in its last three dims and the
    metadata's int tensors on the same device. Decode steps (max_query_len 1) are graph safe. With `flash`
    (`long_prefill.flash_varlen`), an eager step with prompt rows over a long context goes through it.
    """

    # Kept out of torch.compile, write and attention as one opaque call: the kernels pick tiles from host
    # ints of the metadata, which would make a compiled layer recompile for every new prefill length.
    forward = torch.compiler.disable(AttentionBackend.forward)

    def __init__(self, flash: long_prefill.Varlen | None = None) -> None:
        self.flash = flash
        # the last gathering step's metadata and its keys' slots: every layer of a step gathers the same keys,
        # and a dozen small launches a layer would cost more than the gather itself where the host is slow
        self._keys: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def scratch_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 0 if self.flash is None else long_prefill.scratch_bytes(kv_heads, head_dim, dtype)

    def warm_up(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """One call of the long-prefill kernel on a small case of this layout: a Triton kernel builds one variant
        per layout and dtype (its row and key counts are left unspecialized), which no warm-up step reaches
        below `MIN_KEYS` keys."""
        if self.flash is None or dtype not in long_prefill.DTYPES:
            return
        rows, keys = long_prefill.MIN_ROWS, 2 * long_prefill.MIN_ROWS
        q = torch.randn(rows, heads, head_dim, dtype=dtype, device=device)
        k, v = torch.randn(2, keys, kv_heads, head_dim, dtype=dtype, device=device)
        cu_q = torch.tensor([0, rows], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, keys], dtype=torch.int32, device=device)
        self.flash(q, k, v, cu_q, cu_k, rows, keys, head_dim**-0.5)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kernels.write_kv(kv_cache, k, v, slots)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if self.flash is not None and long_prefill.applies(meta, q.dtype):
            if self._keys is None or self._keys[0] is not meta:
                self._keys = (meta, *long_prefill.key_slots(meta, kv_cache.shape[2]))
            return long_prefill.attend(q, kv_cache, meta, scale, self.flash, self._keys[1:])
        return kernels.paged_attention(q, kv_cache, meta, scale)
