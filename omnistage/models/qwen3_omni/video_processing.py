"""Video frames to the flat patches and grid the vision encoder reads (Qwen2-VL video preprocessing).

The rules of transformers' `Qwen2VLVideoProcessor` as its Qwen3-Omni processor calls it: frames sampled at
`fps` from the decoded stream (their count within [min_frames, max_frames] and the stream's, rounded down to
a multiple of the temporal patch), each frame resized to a multiple of patch * merge within the video pixel
bounds (torch's antialiased bicubic on uint8, what torchvision runs on the CPU), rescaled and normalised, then
cut into patches [C, T, P, P] of T consecutive frames, merge block by merge block; a frame count that is not
a multiple of T repeats the last frame. One temporal patch lasts `temporal_patch_size / fps` seconds: the
time step of the video's M-RoPE positions.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from omnistage.errors import InvalidMedia
from omnistage.models.cpu_threads import shared_threads
from omnistage.models.multimodal import patches_digest
from omnistage.models.qwen3_omni.image_processing import smart_resize

VIDEO_CONFIG = "video_preprocessor_config.json"
MAX_PATCH_THREADS = 8  # threads reordering one video's patches at most


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The released processor's video settings. The pixel bounds are those transformers' Qwen3-Omni processor
    passes its video processor (128 and 768 merged tokens a frame), whatever the video config says."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, directory: str | Path) -> VideoProcessorConfig:
        """A checkpoint's video_preprocessor_config.json (the defaults where it or a key is absent)."""
        path = Path(directory) / VIDEO_CONFIG
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        given = {f.name: data[f.name] for f in fields(cls) if f.name in data and "pixels" not in f.name}
        for key in ("image_mean", "image_std"):
            if key in given:
                given[key] = tuple(given[key])
        return cls(**given)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def released_video_config() -> dict:
    """The video_preprocessor_config.json a Qwen3-Omni checkpoint ships (make-tiny writes it): transformers'
    Qwen2VLVideoProcessor with the defaults above, sampling frames itself."""
    cfg = VideoProcessorConfig()
    steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames")
    return {
        "processor_class": "Qwen3OmniMoeProcessor",
        "video_processor_type": "Qwen2VLVideoProcessor",
        **dict.fromkeys(steps, True),
        "size": {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        **{f.name: getattr(cfg, f.name) for f in fields(cfg) if "pixels" not in f.name},
    }


@dataclass
class DecodedVideo:
    """A video as the processor takes it: its sampled frames and, where asked, its sound track."""

    frames: np.ndarray  # uint8 [T, H, W, 3] RGB, the sampled frames in order
    fps: float  # the rate the frames were sampled at: a temporal patch lasts temporal_patch_size / fps s
    audio: np.ndarray | None = None  # float32 mono at 16 kHz, decoded when use_audio_in_video is asked
    # its patches, grid and encoder-cache key per processor config, made once (a video kept decoded is
    # featurised again with every request that sends it: `media.DecodedVideos`)
    _patches: dict[VideoProcessorConfig, tuple[torch.Tensor, tuple[int, int, int], bytes]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def patches(self, cfg: VideoProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int], bytes]:
        """(patches, grid) as `preprocess_video` makes them of the frames, and their `patches_digest`."""
        if (made := self._patches.get(cfg)) is None:
            pixels, grid = preprocess_video(self.frames, cfg)
            made = self._patches[cfg] = pixels, grid, patches_digest(pixels, grid)
        return made


def sample_indices(
    total_frames: int, stream_fps: float, cfg: VideoProcessorConfig, fps: float, max_frames: int
) -> list[int]:
    """The indices of the frames sampled from a stream of `total_frames` at `stream_fps`: `fps` a second, their
    count within [min_frames, min(max_frames, total)] rounded down to a whole number of temporal patches."""
    t = cfg.temporal_patch_size
    most = math.floor(min(max_frames, total_frames) / t) * t
    wanted = total_frames / stream_fps * fps
    count = math.floor(min(max(wanted, cfg.min_frames), most, total_frames) / t) * t
    if count <= 0:
        raise InvalidMedia(
            f"video has {total_frames} frames; at least {t} are needed (one temporal patch of the encoder)"
        )
    return torch.arange(0, total_frames, total_frames / count).int().tolist()


def video_grid(num_frames: int, height: int, width: int, cfg: VideoProcessorConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of `num_frames` frames of this size, without touching their pixels."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    t = -(-num_frames // cfg.temporal_patch_size)
    return t, h // cfg.patch_size, w // cfg.patch_size


def video_tokens(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """Thinker tokens (video_pad placeholders) of a video grid: one per merge x merge block of a temporal patch."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def seconds_per_grid(cfg: VideoProcessorConfig, fps: float) -> float:
    """How long one temporal patch of frames sampled at `fps` lasts."""
    return cfg.temporal_patch_size / fps


def check_fps(cfg: VideoProcessorConfig, fps: float) -> None:
    """Refuse a sampling rate whose temporal patch does not last a whole number of seconds. transformers
    places a video's tokens at t x seconds x position_id_per_seconds in floats: whole seconds keep every
    position an exact integer, as the engine's are; other rates (2.6 fps: 0.769 s) drift off the integers
    a patch or two in, so its positions could not be matched."""
    seconds = cfg.temporal_patch_size / fps
    if not (fps > 0 and seconds.is_integer()):
        rates = ", ".join(f"{cfg.temporal_patch_size / k:.3g}" for k in range(1, 5))
        raise InvalidMedia(
            f"video fps {fps:g} is not one the positions admit: a temporal patch ({cfg.temporal_patch_size} "
            f"frames) must last whole seconds, so fps is {cfg.temporal_patch_size} / k ({rates}, ...)"
        )


def temporal_step(cfg: VideoProcessorConfig, fps: float, position_id_per_seconds: int) -> int:
    """The M-RoPE temporal step between two temporal patches of frames sampled at `fps` (see check_fps)."""
    check_fps(cfg, fps)
    return round(cfg.temporal_patch_size / fps) * position_id_per_seconds


def resized(frames: np.ndarray, cfg: VideoProcessorConfig) -> np.ndarray:
    """uint8 [T, H, W, 3] frames at the size the processor resizes them to (each frame on its own, so the
    decoder resizes a frame as soon as it is decoded and holds no full-size frames)."""
    _, height, width, _ = frames.shape
    size = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if size == (height, width):
        return frames
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    with shared_threads():
        video = F.interpolate(video, size=size, mode="bicubic", align_corners=False, antialias=True)
        return video.permute(0, 2, 3, 1).contiguous().numpy()


def preprocess_video(
    frames: np.ndarray, cfg: VideoProcessorConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Sampled frames uint8 [T, H, W, 3] to (patches [t*h*w, C*T*P*P] uint8, grid (t, h, w)): their bytes in
    patch order, which `PixelNorm.of(cfg)` makes the vision tower's input."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise InvalidMedia(
            f"video frames must be uint8 [frames, height, width, 3], got {frames.dtype} {list(frames.shape)}"
        )
    count, height, width, _ = frames.shape
    grid = video_grid(count, height, width, cfg)
    return _patches(resized(frames, cfg), count, grid, cfg), grid


def _patches(
    frames: np.ndarray, count: int, grid: tuple[int, int, int], cfg: VideoProcessorConfig
) -> torch.Tensor:
    """Frames uint8 [T, H, W, C] at their processor size, their bytes in the vision tower's patch order
    (`PixelNorm` makes them floats where the tower runs: here a 30 s video's patches move 133 MB, where its
    floats were 530 MB, whose first touch alone took most of a second on a cold host, RESULTS.md). The
    temporal patches are reordered on this thread's share of the cores at once (numpy's copies release the
    interpreter's lock): one thread took ~140 ms for a 30 s 720p video on a GPU server's host."""
    grid_t, grid_h, grid_w = grid
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if pad := -count % t:
        frames = np.concatenate((frames, np.repeat(frames[-1:], pad, axis=0)))
    c = frames.shape[-1]
    # (grid t, T, block row, row in block, P, block col, col in block, P, C) -> blocks, then each patch [C, T, P, P]
    blocks = frames.reshape(grid_t, t, grid_h // m, m, p, grid_w // m, m, p, c)
    order = (0, 2, 5, 3, 6, 8, 1, 4, 7)
    ordered = np.empty([blocks.shape[axis] for axis in order], dtype=blocks.dtype)

    def reorder(part: slice) -> None:
        ordered[part] = blocks[part].transpose(order)

    with shared_threads() as share:
        parts = min(share, grid_t, MAX_PATCH_THREADS)
        bounds = np.linspace(0, grid_t, parts + 1).round().astype(int)
        slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        if parts == 1:
            reorder(slices[0])
        else:
            with ThreadPoolExecutor(parts, thread_name_prefix="video-patches") as pool:
                list(pool.map(reorder, slices))
    return torch.from_numpy(ordered).view(grid_t * grid_h * grid_w, c * t * p * p)
