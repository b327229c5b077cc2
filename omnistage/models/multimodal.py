"""A prompt's media as a family's processor hands them to the encoders: one shape for every family."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash


@dataclass
class MultimodalInputs:
    """What the encoders of one prompt read, every list in prompt order."""

    audio_features: list[torch.Tensor]  # [128, frames] log-mel per clip (float32, on the host)
    # audio_pad placeholders per clip; a video's sound track (use_audio_in_video) is a clip in its place
    num_audio_tokens: list[int]
    pixel_values: torch.Tensor | None  # [patches, C*T*P*P] of every image, packed (float32, CPU)
    image_grid_thw: torch.Tensor | None  # [images, 3] int64
    num_image_tokens: list[int]  # image_pad placeholders per image
    pixel_values_videos: torch.Tensor | None = (
        None  # [patches, C*T*P*P] of every video, packed (float32, CPU)
    )
    video_grid_thw: torch.Tensor | None = None  # [videos, 3] int64
    num_video_tokens: list[int] = field(default_factory=list)  # video_pad placeholders per video
    video_seconds_per_grid: list[float] = field(default_factory=list)  # how long a temporal patch lasts
    use_audio_in_video: bool = False  # every video's sound track is interleaved with its frames
    audio_keys: list[bytes] = field(default_factory=list)  # clip_digest of each clip, the encoder cache's key


def clip_digest(samples: torch.Tensor) -> bytes:
    """A clip's key in the encoder cache: a 128-bit XXH3 digest of the samples a processor featurises (their
    dtype and count in it). Taken on the host where the clip is featurised, so that the engine never reads
    features back from the device to know a clip: each such read waits for every step queued before it."""
    host = samples.detach().to("cpu").contiguous()
    digest = xxhash.xxh3_128(f"{host.dtype}{tuple(host.shape)}".encode())
    digest.update(host.view(torch.uint8).numpy().data)
    return digest.digest()
