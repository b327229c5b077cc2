"""What a family hands the encoder stage (`encoders.py`): its towers as the stage calls them eagerly, and how
its processor lays out clips, images and videos for them. The stage names no family; Qwen3-Omni's are built in
pipeline/qwen3_omni_encoders.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from omnistage.engine.graphs.encoders import AudioTower, VisionTower
from omnistage.models.multimodal import PixelNorm


class EagerAudioTower(AudioTower, Protocol):
    """An audio tower the stage also calls eagerly: clips' features [mel, frames_i] to their rows [tokens_i, H]."""

    def __call__(self, features: list[torch.Tensor]) -> list[torch.Tensor]: ...


class EagerVisionTower(VisionTower, Protocol):
    """A vision tower the stage also calls eagerly: packed patches of images with their (t, h, w) grids to their
    rows [n, H] and one such tensor per deepstack level."""

    def __call__(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def compile_regions(self) -> None:
        """torch.compile what runs between its GEMMs and attention kernels, for any patch count."""


@dataclass(frozen=True)
class AudioFormat:
    """A family's clips as its processor makes them for the audio tower."""

    token_id: int  # the prompt placeholder one audio row fills
    hop_length: int  # samples a mel frame advances by
    sample_rate: int
    max_frames: int  # mel frames of the longest clip the processor admits
    # clips' features [mel, frames_i] on a device from their waveforms [samples_i] on the host (as a processor
    # hands them: MultimodalInputs.audio_clips), made together on the current stream
    features: Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


@dataclass(frozen=True)
class ImageFormat:
    """A family's images as its processor makes them for the vision tower."""

    token_id: int  # the prompt placeholder one image row fills
    largest_grid: tuple[int, int, int]  # (t, h, w) patches of the largest image the processor admits
    patch_size: int  # pixels along a patch's side
    patch_values: int  # values in one patch row (channels x temporal patch x patch_size^2)
    spatial_merge_size: int  # a merge x merge block of patches is one row
    norm: PixelNorm | None = None  # what makes a patch's bytes the tower's input (None: patches are floats)


@dataclass(frozen=True)
class VideoFormat:
    """A family's videos as its processor makes them for the vision tower (patches as its images')."""

    token_id: int  # the prompt placeholder one video row fills
