"""Non-causal attention within segments of packed tokens: the encoders' one attention site (audio windows,
image patches)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from omnistage.models.layers.attention_metadata import to_device

_flash_varlen: Callable[..., Any] | None
try:  # FlashAttention's varlen kernel, in torch since 2.10 (CUDA, half precision)
    from torch.nn.attention.varlen import varlen_attn as _flash_varlen
except ImportError:  # pragma: no cover - older torch builds
    _flash_varlen = None


@dataclass(frozen=True)
class Segments:
    """Attention segments over packed tokens: host boundaries, and on a GPU the same as an int32 tensor.

    Built once per encoder call and shared by its layers, so the fused kernel's boundaries cross to the
    device once. A CUDA graph's segments live only in a static int32 tensor that is rewritten between
    replays (`static`): segments may be empty there (padding), and `max_len` is a bound fixed at capture.
    """

    bounds: list[int] | None  # cu_seqlens: segment i is tokens [bounds[i], bounds[i+1]); None: static
    device_bounds: torch.Tensor | None
    max_len: int

    @classmethod
    def of(cls, bounds: list[int], device: torch.device) -> Segments:
        fused = device.type == "cuda" and _flash_varlen is not None
        cu = to_device(torch.tensor(bounds, dtype=torch.int32), device) if fused else None
        return cls(list(bounds), cu, max((b - a for a, b in zip(bounds, bounds[1:])), default=0))

    @classmethod
    def static(cls, device_bounds: torch.Tensor, max_len: int) -> Segments:
        """Boundaries held in `device_bounds` (int32, on the tokens' device), no segment longer than `max_len`."""
        return cls(None, device_bounds, max_len)

    def host_bounds(self) -> list[int]:
        """The boundaries as host ints (for static segments a read of the device tensor: not in a capture)."""
        if self.bounds is not None:
            return self.bounds
        assert self.device_bounds is not None  # static segments: `static` always gives the device tensor
        return self.device_bounds.tolist()


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | list[int]
) -> torch.Tensor:
    """Non-causal attention within each segment of packed q, k, v [tokens, heads, dim].

    The one attention site of the encoders. On a GPU in half precision it is one FlashAttention varlen
    call. Elsewhere this reference batches the segments of each distinct length into one unmasked SDPA
    call (no padding): audio windows are nearly all 104 tokens, and an image is one segment.
    """
    if not isinstance(segments, Segments):
        segments = Segments.of(segments, q.device)
    cu = segments.device_bounds
    half = q.dtype in (torch.bfloat16, torch.float16)
    if _flash_varlen is not None and cu is not None and q.is_cuda and half:
        return _flash_varlen(q, k, v, cu, cu, segments.max_len, segments.max_len)
    return _grouped_sdpa(q, k, v, segments.host_bounds())


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        if end > start:  # an empty segment (a static layout's padding) attends to nothing
            starts_by_length.setdefault(end - start, []).append(start)
    tokens, heads, dim = q.shape
    tiled = [length * len(starts) for length, starts in starts_by_length.items()] == [tokens]
    if tiled:  # equal segments tile the packed tokens: a view, no copies
        ((length, starts),) = starts_by_length.items()
        sq, sk, sv = (t.view(len(starts), length, heads, dim).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(sq, sk, sv).transpose(1, 2).reshape(tokens, heads, dim)
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        index = (
            to_device(torch.tensor(starts), q.device)[:, None] + torch.arange(length, device=q.device)
        ).flatten()
        sq, sk, sv = (t[index].view(len(starts), length, heads, dim).transpose(1, 2) for t in (q, k, v))
        out[index] = F.scaled_dot_product_attention(sq, sk, sv).transpose(1, 2).reshape(-1, heads, dim)
    return out
