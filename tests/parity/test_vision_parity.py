"""Image preprocessing and the vision encoder against transformers (float32, CPU, tiny random checkpoint).

transformers' default `Qwen2VLImageProcessor` needs torchvision, which conflicts with the CPU torch here;
its PIL backend `Qwen2VLImageProcessorPil` is the reference (the released pipeline with torchvision
resizes with torch's antialiased bicubic instead, which can differ by a level or so of 255 on resized
images; images already at a multiple of 32 pixels per side are unaffected).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.bench.hf_layout import visual
from omnistage.errors import InvalidMedia
from omnistage.models.loader import LoadOptions
from omnistage.models.multimodal import PixelNorm
from omnistage.models.qwen3_omni.image_processing import (
    ImageProcessorConfig,
    decode_image,
    image_tokens,
    preprocess_images,
    smart_resize,
)
from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG, make_tiny
from omnistage.models.qwen3_omni.vision_encoder import load_vision_encoder

ENCODER_TOLERANCE = 1e-4  # max abs error relative to the reference's max abs
# (height, width): resized to 64x96 and 128x64; the last one is scaled up past min_pixels to 64x96.
SIZES = [(67, 101), (130, 61), (20, 30)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_visual(checkpoint):
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return visual(model.thinker).eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_vision_encoder(checkpoint, LoadOptions(torch.float32, "cpu"))


def images(sizes=SIZES) -> list[Image.Image]:
    """Smooth gradients plus noise: resampling matters and every pixel differs."""
    rng = np.random.default_rng(0)
    out = []
    for h, w in sizes:
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([255 * x / w, 255 * y / h, 128 + 100 * np.sin(x / 5 + y / 7)], axis=-1)
        out.append(Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)))
    return out


def test_preprocessing_matches_transformers(checkpoint):
    keys = ("do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "image_mean")
    keys += ("image_std", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
    processor = Qwen2VLImageProcessorPil(**{k: PREPROCESSOR_CONFIG[k] for k in keys})
    reference = processor(images(), return_tensors="pt")
    cfg = ImageProcessorConfig.from_dir(checkpoint)
    patches, grid_thw = preprocess_images(images(), cfg)
    assert patches.dtype == torch.uint8
    pixel_values = PixelNorm.of(cfg)(patches)
    assert grid_thw.tolist() == reference["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4], [1, 4, 6]]
    assert pixel_values.shape == reference["pixel_values"].shape == (24 + 32 + 24, 3 * 2 * 16 * 16)
    assert (pixel_values - reference["pixel_values"]).abs().max().item() <= 1e-6
    assert [image_tokens(tuple(g)) for g in grid_thw.tolist()] == [6, 8, 6]


def test_bad_images_raise_invalid_media():
    with pytest.raises(InvalidMedia, match="empty"):
        decode_image(b"")
    with pytest.raises(InvalidMedia, match="could not be decoded: not an image format Pillow reads") as bad:
        decode_image(b"\x89PNG not really")
    assert "BytesIO" not in str(bad.value)  # the reader's repr says nothing to a client
    with pytest.raises(InvalidMedia, match="aspect ratio"):
        smart_resize(10, 2500, 32, 3136, 12845056)
    buf = io.BytesIO()
    Image.new("RGBA", (40, 30)).save(buf, format="PNG")
    assert decode_image(buf.getvalue()).mode == "RGB"


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_encoder_and_deepstack_match_transformers(checkpoint, ours, hf_visual):
    cfg = ImageProcessorConfig.from_dir(checkpoint)
    patches, grid_thw = preprocess_images(images(SIZES[:2]), cfg)
    pixel_values = PixelNorm.of(cfg)(patches)
    embeds, deepstack = ours(pixel_values, grid_thw)
    ref = hf_visual(pixel_values, grid_thw=grid_thw)
    assert embeds.shape == ref.pooler_output.shape == (14, ours.cfg.out_hidden_size)
    assert relative_error(embeds, ref.pooler_output) <= ENCODER_TOLERANCE
    assert len(deepstack) == len(ref.deepstack_features) == len(ours.cfg.deepstack_visual_indexes)
    for level, ref_level in zip(deepstack, ref.deepstack_features):
        assert level.shape == embeds.shape
        assert relative_error(level, ref_level) <= ENCODER_TOLERANCE

    # The ragged batch is each image alone.
    patch_offset, token_offset = 0, 0
    for t, h, w in grid_thw.tolist():
        alone, alone_deepstack = ours(pixel_values[patch_offset : patch_offset + t * h * w], [(t, h, w)])
        rows = slice(token_offset, token_offset + alone.shape[0])
        assert relative_error(embeds[rows], alone) <= 1e-5
        for level, alone_level in zip(deepstack, alone_deepstack):
            assert relative_error(level[rows], alone_level) <= 1e-5
        patch_offset += t * h * w
        token_offset += alone.shape[0]
