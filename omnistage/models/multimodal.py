"""A prompt's media as a family's processor hands them to the encoders: one shape for every family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import xxhash

from omnistage.models.layers.attention_metadata import to_device_together


class Normalisation(Protocol):
    """A processor config's normalisation of pixel values."""

    @property
    def rescale_factor(self) -> float: ...
    @property
    def image_mean(self) -> tuple[float, ...]: ...
    @property
    def image_std(self) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class PixelNorm:
    """How a processor turns a patch's bytes into the vision tower's input, per channel c: (byte − shift[c]) /
    scale[c] in float32, with shift = mean / rescale and scale = std / rescale (transformers' arithmetic, the
    rescale folded into the normalisation as its fast processors fold it). The processors leave patches as
    bytes and the encoders apply this where they run: the host then holds, hashes and copies a byte a value
    instead of four."""

    shift: tuple[float, ...]
    scale: tuple[float, ...]

    @classmethod
    def of(cls, cfg: Normalisation) -> PixelNorm:
        """A config's, its constants computed in float32 as the patches' floats are."""
        shift = torch.tensor(cfg.image_mean, dtype=torch.float32) / cfg.rescale_factor
        scale = torch.tensor(cfg.image_std, dtype=torch.float32) / cfg.rescale_factor
        return cls(tuple(shift.tolist()), tuple(scale.tolist()))

    def __call__(self, patches: torch.Tensor) -> torch.Tensor:
        """uint8 patches `[n, C·K]` (each patch's channels in turn) → float32 `[n, C·K]` on their device."""
        rows, width = patches.shape
        channels = len(self.shift)
        shift, scale = to_device_together(
            [torch.tensor(self.shift, dtype=torch.float32), torch.tensor(self.scale, dtype=torch.float32)],
            patches.device,
        )
        shape = (rows, channels, width // channels)
        # on the host numpy's memory, which asks the kernel for huge pages: a 30 s video's 530 MB then faults
        # in a few hundred pages, where torch's allocation took 130,000 (RESULTS.md, "Video decoding and
        # processing on the CPU")
        if patches.device.type == "cpu":
            out = torch.from_numpy(np.empty(shape, np.float32))
        else:
            out = torch.empty(shape, dtype=torch.float32, device=patches.device)
        out.copy_(patches.view(shape)).sub_(shift[None, :, None]).div_(scale[None, :, None])
        return out.view(rows, width)


@dataclass
class MultimodalInputs:
    """What the encoders of one prompt read, every list in prompt order."""

    # per clip its 16 kHz waveform [samples], float32 on the host: the encoder stage makes the features of all
    # the clips it admits at once, on its device (`AudioFormat.features`)
    audio_clips: list[torch.Tensor]
    # audio_pad placeholders per clip; a video's sound track (use_audio_in_video) is a clip in its place
    num_audio_tokens: list[int]
    pixel_values: torch.Tensor | None  # [patches, C*T*P*P] of every image, packed (uint8, CPU: `image_norm`)
    image_grid_thw: torch.Tensor | None  # [images, 3] int64
    num_image_tokens: list[int]  # image_pad placeholders per image
    pixel_values_videos: torch.Tensor | None = None  # as pixel_values, of every video (`video_norm`)
    video_grid_thw: torch.Tensor | None = None  # [videos, 3] int64
    num_video_tokens: list[int] = field(default_factory=list)  # video_pad placeholders per video
    video_seconds_per_grid: list[float] = field(default_factory=list)  # how long a temporal patch lasts
    use_audio_in_video: bool = False  # every video's sound track is interleaved with its frames
    audio_keys: list[bytes] = field(default_factory=list)  # clip_digest of each clip, the encoder cache's key
    # patches_digest of each image and of each video: their keys in the encoder cache (none: not kept)
    image_keys: list[bytes] = field(default_factory=list)
    video_keys: list[bytes] = field(default_factory=list)
    image_norm: PixelNorm | None = None  # what makes the images' bytes the vision tower's input
    video_norm: PixelNorm | None = None


def clip_digest(samples: torch.Tensor) -> bytes:
    """A clip's key in the encoder cache: a 128-bit XXH3 digest of the samples a processor featurises (their
    dtype and count in it). Taken on the host where the clip is featurised, so that the engine never reads
    features back from the device to know a clip: each such read waits for every step queued before it."""
    host = samples.detach().to("cpu").contiguous()
    digest = xxhash.xxh3_128(f"{host.dtype}{tuple(host.shape)}".encode())
    digest.update(host.view(torch.uint8).numpy().data)
    return digest.digest()


def patches_digest(patches: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    """An image's or a video's key in the encoder cache: a 128-bit XXH3 digest of its patches as the processor
    made them (on the host: bytes, or floats where a family's processor normalises them) and their grid. XXH3
    reads a 30 s 720p video's 133 MB in ~10 ms, a small share of what the vision tower's ~300 ms cost."""
    host = patches.detach().contiguous()
    digest = xxhash.xxh3_128(f"{host.dtype}{tuple(host.shape)}{tuple(grid)}".encode())
    digest.update(host.view(torch.uint8).numpy().data)
    return digest.digest()
