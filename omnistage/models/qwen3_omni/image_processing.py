"""Images to the flat patches and grid the vision encoder reads (Qwen2-VL preprocessing).

Matches transformers' `Qwen2VLImageProcessorPil` (the PIL backend, used where torchvision is absent):
resize with PIL bicubic to a multiple of patch * merge within [min_pixels, max_pixels], rescale,
normalise, and lay patches out merge-block by merge-block, each patch as [C, T, P, P] with the image
repeated over the T temporal slots.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from omnistage.errors import InvalidMedia

log = logging.getLogger(__name__)

MAX_ASPECT_RATIO = 200
# A decompression-bomb guard: 10x the released max_pixels, which is all the encoder keeps after resizing.
MAX_DECODED_PIXELS = 128_000_000


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, directory: str | Path) -> ImageProcessorConfig:
        """Read the image settings of a checkpoint's preprocessor_config.json (defaults where absent)."""
        data = json.loads((Path(directory) / "preprocessor_config.json").read_text())
        size = data.get("size") or {}
        fields = {
            "patch_size": data.get("patch_size"),
            "temporal_patch_size": data.get("temporal_patch_size"),
            "merge_size": data.get("merge_size"),
            "min_pixels": data.get("min_pixels", size.get("shortest_edge")),
            "max_pixels": data.get("max_pixels", size.get("longest_edge")),
            "rescale_factor": data.get("rescale_factor"),
            "image_mean": tuple(data["image_mean"]) if "image_mean" in data else None,
            "image_std": tuple(data["image_std"]) if "image_std" in data else None,
        }
        return cls(**{k: v for k, v in fields.items() if v is not None})


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes (any format PIL reads) to an RGB PIL image."""
    if not data:
        raise InvalidMedia("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_DECODED_PIXELS:
            raise InvalidMedia(
                f"image is {image.width}x{image.height} pixels, more than the {MAX_DECODED_PIXELS:,} accepted"
            )
        image.load()
    except UnidentifiedImageError:
        raise InvalidMedia("image could not be decoded: not an image format Pillow reads") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidMedia(f"image could not be decoded: {exc}") from None
    return image.convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size nearest (height, width) with both sides multiples of `factor` and area in the pixel bounds."""
    if min(height, width) <= 0:
        raise InvalidMedia(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidMedia(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image of this size, without touching its pixels."""
    h, w = smart_resize(height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def largest_grid(cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """(t, h, w) of the most patches any image resizes to: the vision encoder's largest input."""
    factor = cfg.patch_size * cfg.merge_size
    blocks = max(1, cfg.max_pixels // factor**2)  # resized sides are multiples of factor, area <= max_pixels
    rows, cols = max(
        ((a, min(blocks // a, MAX_ASPECT_RATIO * a)) for a in range(1, math.isqrt(blocks) + 1)),
        key=lambda grid: (grid[0] * grid[1], grid[0]),  # the squarest of the largest
    )
    return 1, rows * cfg.merge_size, cols * cfg.merge_size


def image_tokens(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """Thinker tokens (image_pad placeholders) of an image grid: one per merge x merge patch block."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def preprocess_image(
    image: Image.Image, cfg: ImageProcessorConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image to (patches [h*w, C*T*P*P] uint8, grid (1, h, w)): the resized image's bytes in patch order,
    which `PixelNorm.of(cfg)` makes the vision tower's input."""
    image = image.convert("RGB")
    _, grid_h, grid_w = image_grid(image.height, image.width, cfg)
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if image.height * image.width > cfg.max_pixels:  # what the memory plan's vision floor was measured on
        log.info(
            "an image of %dx%d is resized to %dx%d (max_pixels %d)",
            image.width, image.height, grid_w * p, grid_h * p, cfg.max_pixels,
        )  # fmt: skip
    image = image.resize((grid_w * p, grid_h * p), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.uint8)  # [H, W, C]
    c = pixels.shape[-1]
    # [H, W, C] -> (block row, block col, row in block, col in block, C, P, P): merge blocks stay contiguous.
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return torch.from_numpy(patches.reshape(grid_h * grid_w, c * t * p * p).copy()), (1, grid_h, grid_w)


def preprocess_images(
    images: list[Image.Image], cfg: ImageProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several images to packed patches [sum h*w, C*T*P*P] (uint8) and grid_thw [images, 3] (int64)."""
    if not images:
        raise ValueError("no images to preprocess")
    done = [preprocess_image(image, cfg) for image in images]
    grid_thw = torch.tensor([grid for _, grid in done], dtype=torch.int64)
    return torch.cat([patches for patches, _ in done]), grid_thw
