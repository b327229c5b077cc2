"""A chat's decoded media parts: found in prompt order, featurised for the encoders, their placeholders expanded.

Clips stay float32 waveforms (the encoder stage makes their log-mel features), images and videos become
patches; every `<|audio_pad|>`, `<|image_pad|>` and `<|video_pad|>` the template renders becomes as many
placeholders as the encoders emit. With `use_audio_in_video` each video's sound track is a clip in the video's
place (the order the audio tower's rows fill the prompt in) and its pad becomes the interleaved layout of
video_layout.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omnistage.errors import InvalidMedia, InvalidRequest
from omnistage.models.multimodal import MultimodalInputs, PixelNorm, clip_digest, patches_digest
from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens
from omnistage.models.qwen3_omni.audio_features import HOP_LENGTH, clip_waveform
from omnistage.models.qwen3_omni.config import ThinkerConfig
from omnistage.models.qwen3_omni.image_processing import (
    MAX_DECODED_PIXELS,
    ImageProcessorConfig,
    image_tokens,
    preprocess_images,
)
from omnistage.models.qwen3_omni.video_layout import frame_times, with_audio_tokens
from omnistage.models.qwen3_omni.video_processing import (
    DecodedVideo,
    VideoProcessorConfig,
    seconds_per_grid,
    temporal_step,
    video_tokens,
)

AUDIO_PARTS = ("audio", "input_audio", "audio_url")
IMAGE_PARTS = ("image", "image_url")
VIDEO_PARTS = ("video", "video_url")


@dataclass
class MediaParts:
    """(kind, where, value) of every decoded media part, in the order the template renders them."""

    items: list[tuple[str, str, object]]

    def of(self, kind: str) -> list[tuple[str, object]]:
        return [(where, value) for k, where, value in self.items if k == kind]


@dataclass(frozen=True)
class MediaFormats:
    """How the checkpoint's processor featurises each kind of media."""

    thinker: ThinkerConfig
    images: ImageProcessorConfig
    videos: VideoProcessorConfig


def media_parts(messages: list[dict]) -> MediaParts:
    """The audio, image and video parts of `messages`, each already decoded."""
    items = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                continue
            for decoded, aliases in (("audio", AUDIO_PARTS), ("image", IMAGE_PARTS), ("video", VIDEO_PARTS)):
                if kind not in aliases:
                    continue
                if kind != decoded or decoded not in part:
                    article = "an" if kind[0] in "aeiou" else "a"
                    raise InvalidMedia(
                        f"{where}: {article} {kind} part must be decoded to {{'type': '{decoded}', "
                        f"'{decoded}': ...}}"
                    )
                items.append((decoded, where, part[decoded]))
    return MediaParts(items)


def featurise(parts: MediaParts, formats: MediaFormats, use_audio_in_video: bool) -> MultimodalInputs:
    """Every part's patches, and every clip's waveform (the encoder stage makes their features: `log_mels`), in
    prompt order; with `use_audio_in_video` each video's sound track is a clip in the video's place."""
    merge = formats.thinker.vision.spatial_merge_size
    clips, keys, patches, grids, video_patches, video_grids, seconds = [], [], [], [], [], [], []
    image_keys, video_keys = [], []
    for kind, where, value in parts.items:
        with _part(where):
            if kind == "audio":
                samples = clip_waveform(_waveform(value))
                clips.append(samples)
                keys.append(clip_digest(samples))
            elif kind == "image":
                pixels, grid = preprocess_images([_image(value)], formats.images)
                patches.append(pixels)
                grids.append(grid)
                image_keys.append(patches_digest(pixels, tuple(grid[0].tolist())))
            else:
                video = _video(value, formats.videos)
                temporal_step(formats.videos, video.fps, formats.thinker.position_id_per_seconds)
                pixels, thw, key = video.patches(formats.videos)
                video_patches.append(pixels)
                video_grids.append(thw)
                video_keys.append(key)
                seconds.append(seconds_per_grid(formats.videos, video.fps))
                if use_audio_in_video:
                    if video.audio is None:
                        raise InvalidMedia("video has no audio track, and use_audio_in_video asks for one")
                    samples = clip_waveform(_waveform(video.audio))
                    clips.append(samples)
                    keys.append(clip_digest(samples))
    grid_thw = torch.cat(grids) if grids else None
    video_thw = torch.tensor(video_grids, dtype=torch.int64) if video_grids else None
    return MultimodalInputs(
        audio_clips=clips,
        num_audio_tokens=[
            audio_output_tokens(c.numel() // HOP_LENGTH, formats.thinker.audio.n_window) for c in clips
        ],
        pixel_values=_joined(patches),
        image_grid_thw=grid_thw,
        num_image_tokens=[] if grid_thw is None else [image_tokens(g, merge) for g in grid_thw.tolist()],
        pixel_values_videos=_joined(video_patches),
        video_grid_thw=video_thw,
        num_video_tokens=[video_tokens(g, merge) for g in video_grids],
        video_seconds_per_grid=seconds,
        use_audio_in_video=use_audio_in_video and bool(video_grids),
        audio_keys=keys,
        image_keys=image_keys,
        video_keys=video_keys,
        image_norm=PixelNorm.of(formats.images) if patches else None,
        video_norm=PixelNorm.of(formats.videos) if video_patches else None,
    )


def expand_placeholders(token_ids: list[int], mm: MultimodalInputs, cfg: ThinkerConfig) -> list[int]:
    """`token_ids` with each media pad expanded to its encoder's rows (a video with its sound track, to both
    merged in time order between `<|audio_start|>` and `<|audio_end|>`)."""
    audio, images = iter(mm.num_audio_tokens), iter(mm.num_image_tokens)
    grids = [] if mm.video_grid_thw is None else [tuple(g) for g in mm.video_grid_thw.tolist()]
    videos = iter(zip(grids, mm.video_seconds_per_grid, mm.num_video_tokens))
    merge = cfg.vision.spatial_merge_size
    expanded: list[int] = []
    for token in token_ids:
        if token == cfg.audio_token_id:
            expanded += [token] * next(audio)
        elif token == cfg.image_token_id:
            expanded += [token] * next(images)
        elif token == cfg.video_token_id:
            grid, seconds, count = next(videos)
            if not mm.use_audio_in_video:
                expanded += [token] * count
                continue
            times = frame_times(grid, merge, round(seconds * cfg.position_id_per_seconds))
            merged = with_audio_tokens(times, next(audio), cfg.video_token_id, cfg.audio_token_id)
            expanded += [cfg.audio_start_token_id, *merged, cfg.audio_end_token_id]
        else:
            expanded.append(token)
    return expanded


def check_placeholders(token_ids: list[int], parts: MediaParts, cfg: ThinkerConfig) -> None:
    """The rendered prompt holds one pad per part of each kind (typed pads are text: only the template can
    break this)."""
    for token, kind in (
        (cfg.audio_token_id, "audio"),
        (cfg.image_token_id, "image"),
        (cfg.video_token_id, "video"),
    ):
        rendered, found = token_ids.count(token), len(parts.of(kind))
        if rendered != found:
            raise InvalidRequest(
                f"the chat template rendered {rendered} {kind} placeholders for {found} {kind} attachments"
            )


def _joined(patches: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts' patches as one tensor; a lone part's as they are: a 30 s video's are 530 MB, whose copy into
    fresh memory took 0.38 s on one core (RESULTS.md, "Video decoding and processing on the CPU")."""
    if not patches:
        return None
    return patches[0] if len(patches) == 1 else torch.cat(patches)


def _waveform(audio: object) -> torch.Tensor:
    if not isinstance(audio, np.ndarray | torch.Tensor):
        raise InvalidMedia(f"audio must be a float32 waveform (numpy array), got {type(audio).__name__}")
    x = torch.as_tensor(audio)
    if not x.is_floating_point():
        raise InvalidMedia(f"audio must hold float samples, got {x.dtype}")
    # a sum is finite unless a sample is not (or the sum overflows: then the test of every sample decides),
    # and 30 times faster than that test on one thread (0.08 ms against 2.7 ms for 2 minutes of audio)
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise InvalidMedia("audio holds NaN or infinite samples")
    return x


def _image(image: object) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise InvalidMedia(f"image must be a PIL image, got {type(image).__name__}")
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise InvalidMedia(
            f"image is {image.width}x{image.height} pixels, more than the {MAX_DECODED_PIXELS:,} accepted"
        )
    return image


def _video(video: object, cfg: VideoProcessorConfig) -> DecodedVideo:
    """A decoded video, or frames already sampled at the processor's rate."""
    if isinstance(video, np.ndarray):
        video = DecodedVideo(video, cfg.fps)
    if not isinstance(video, DecodedVideo):
        raise InvalidMedia(
            f"video must be sampled frames (uint8 [frames, height, width, 3]) or a DecodedVideo, got "
            f"{type(video).__name__}"
        )
    if video.frames.ndim == 4 and len(video.frames) > cfg.max_frames:
        raise InvalidMedia(f"video has too many frames: {len(video.frames)}, the limit is {cfg.max_frames}")
    if video.frames.ndim == 4 and video.frames.shape[1] * video.frames.shape[2] > MAX_DECODED_PIXELS:
        raise InvalidMedia(f"video frames are larger than the {MAX_DECODED_PIXELS:,} pixels accepted")
    return video


@contextmanager
def _part(where: str) -> Iterator[None]:
    """Name the content part in any InvalidMedia raised inside."""
    try:
        yield
    except InvalidMedia as exc:
        raise InvalidMedia(f"{where}: {exc}") from None
