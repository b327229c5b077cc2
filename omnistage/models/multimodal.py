"""A prompt's media as a family's processor hands them to the encoders: one shape for every family."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultimodalInputs:
    """What the encoders of one prompt read, every list in prompt order."""

    audio_features: list[torch.Tensor]  # [128, frames] log-mel per clip (float32, on the processor's device)
    num_audio_tokens: list[int]  # audio_pad placeholders per clip
    pixel_values: torch.Tensor | None  # [patches, C*T*P*P] of every image, packed (float32, CPU)
    image_grid_thw: torch.Tensor | None  # [images, 3] int64
    num_image_tokens: list[int]  # image_pad placeholders per image
