"""Qwen3-Omni's encoder stage: its audio tower (AuT) and vision tower, and how its processor lays out clips,
images and videos for them (`EncoderStage` knows no family). Qwen3-ASR's tower is the same AuT over the same mel."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.engine.stages.encoder_formats import AudioFormat, ImageFormat, VideoFormat
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.models.loader import LoadOptions
from omnistage.models.multimodal import PixelNorm
from omnistage.models.qwen3_omni.audio_encoder import load_audio_encoder
from omnistage.models.qwen3_omni.audio_features import (
    HOP_LENGTH,
    MAX_SECONDS,
    SAMPLE_RATE,
    log_mels,
)
from omnistage.models.qwen3_omni.config import ThinkerConfig
from omnistage.models.qwen3_omni.image_processing import ImageProcessorConfig, largest_grid
from omnistage.models.qwen3_omni.vision_encoder import load_vision_encoder


def aut_clips(audio_token_id: int) -> AudioFormat:
    """Clips as 16 kHz waveforms, up to the longest the processor decodes, whose log-mel features the stage makes
    on its device (`log_mels`)."""
    max_frames = int(MAX_SECONDS * SAMPLE_RATE) // HOP_LENGTH
    return AudioFormat(audio_token_id, HOP_LENGTH, SAMPLE_RATE, max_frames, log_mels)


def image_format(image_token_id: int, cfg: ImageProcessorConfig, spatial_merge_size: int) -> ImageFormat:
    """Images as the processor resizes and cuts them into RGB patches (`image_processing.py`)."""
    patch_values = 3 * cfg.temporal_patch_size * cfg.patch_size**2  # RGB
    return ImageFormat(
        image_token_id, largest_grid(cfg), cfg.patch_size, patch_values, spatial_merge_size, PixelNorm.of(cfg)
    )


def load_encoders(
    checkpoint_dir: Path, cfg: ThinkerConfig, options: LoadOptions, cache_bytes: int = 0
) -> EncoderStage:
    """Qwen3-Omni's audio and vision towers from a checkpoint directory; clips' rows kept up to `cache_bytes`."""
    found = (Path(checkpoint_dir) / "preprocessor_config.json").exists()
    images = ImageProcessorConfig.from_dir(checkpoint_dir) if found else ImageProcessorConfig()
    return EncoderStage(
        load_audio_encoder(checkpoint_dir, options),
        aut_clips(cfg.audio_token_id),
        torch.device(options.device),
        load_vision_encoder(checkpoint_dir, options),
        image_format(cfg.image_token_id, images, cfg.vision.spatial_merge_size),
        VideoFormat(cfg.video_token_id),
        cache_bytes,
    )
