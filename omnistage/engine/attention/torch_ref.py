"""Paged attention in plain torch: slow, any device, the oracle for the GPU backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's pages and runs SDPA with a causal mask offset by the cached length.

    Loops over sequences on the host (`.tolist()`), so it is not CUDA-graph safe. Inputs go to SDPA 4-D:
    with 3-D ones and a mask, torch's CPU dispatch falls back to the unfused path, which writes every
    head's scores (measured on two busy cores, tiny model: a 60k-token prompt prefilled in 201 s, now 20 s).
    """

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        _, num_pages, page_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_pages * page_size, heads, dim)
        keep = slots >= 0
        kept = slots[keep]
        flat[0].index_copy_(0, kept, k[keep].to(kv_cache.dtype))
        flat[1].index_copy_(0, kept, v[keep].to(kv_cache.dtype))

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        page_size = kv_cache.shape[2]
        out = torch.zeros_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for b, seq_len in enumerate(seq_lens):
            q0, q1 = starts[b], starts[b + 1]
            if seq_len == 0 or q1 == q0:
                continue
            pages = meta.block_tables[b, : -(-seq_len // page_size)].long()
            keys = kv_cache[0, pages].flatten(0, 1)[:seq_len]  # [L, Hkv, D]
            values = kv_cache[1, pages].flatten(0, 1)[:seq_len]
            num_new = q1 - q0
            mask = None  # no cached context: plain causal, which the fused kernel also skips work for
            if num_new < seq_len:
                # query i sits at position seq_len - num_new + i and sees keys 0..that position; an additive
                # mask, as the fused kernel wants it (a boolean one is converted at every call)
                mask = torch.full((num_new, seq_len), -torch.inf, dtype=q.dtype, device=q.device)
                mask.triu_(seq_len - num_new + 1)
            attended = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1)[None],
                keys.transpose(0, 1).to(q.dtype)[None],
                values.transpose(0, 1).to(q.dtype)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[q0:q1] = attended[0].transpose(0, 1)
        return out
