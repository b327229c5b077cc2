"""Multimodal RoPE (M-RoPE) with Qwen3-Omni's interleaved frequency layout.

Each token has three position streams (temporal, height, width); text tokens carry the same value in all
three, which reduces M-RoPE to plain RoPE. Frequency i of the head_dim/2 rotary frequencies takes its
angle from stream 1 (height) when i % 3 == 1 and i < 3 * section[1], from stream 2 (width) when
i % 3 == 2 and i < 3 * section[2], and from stream 0 (temporal) otherwise. transformers' Qwen3-Omni
always interleaves this way, whatever the config's `interleaved` flag says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PromptPositions:
    """M-RoPE positions of a multimodal prompt `[3, prompt_len]`; generated tokens continue at p + delta."""

    positions: torch.Tensor
    delta: int


class MRotaryEmbedding(nn.Module):
    """cos/sin `[T, head_dim]` (float32) from positions `[3, T]`; half-split (rotate_half) layout."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]) -> None:
        super().__init__()
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must be 3 sections summing to {head_dim // 2}"
            )
        self.head_dim, self.theta, self.mrope_section = head_dim, theta, tuple(mrope_section)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed per call in float32 rather than kept as a buffer, so model.to(bf16) cannot degrade it
        # and meta-device construction needs no re-initialisation; it is a handful of tiny ops per step.
        exponent = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponent)
        angles = positions.float()[:, :, None] * inv_freq  # [3, T, head_dim/2]
        # Stream 0's angles, overwritten in place where another stream's frequencies go: `angles` is this call's
        # own tensor and those writes read only its other streams, so no clone (a device copy a step) is needed.
        merged = angles[0]
        for stream in (1, 2):
            picked = slice(stream, 3 * self.mrope_section[stream], 3)
            merged[:, picked] = angles[stream, :, picked]
        merged = torch.cat((merged, merged), dim=-1)
        return merged.cos(), merged.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]` by cos/sin `[T, head_dim]` (cast to x's dtype first)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
