"""Media and transformers' processor shared by the parity tests: clips, pictures, content parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from omnistage.models.multimodal import PixelNorm
from omnistage.models.qwen3_omni.audio_features import decode_audio
from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig, preprocess_video

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
# The released tokenizer_config.json names these; the tiny checkpoint's does not, so they are passed here.
MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


class VideoProcessorStub:
    """transformers' video processors need torchvision, which we do not install (its wheels need CUDA's torch).
    transformers' processor reads `merge_size` and `temporal_patch_size` of it and calls it for the videos'
    patches and grids: given here by our preprocessing of the same frames (whose patch layout
    tests/unit/models/test_video_processing.py ties to the image processor's, itself proven against
    transformers'). Placeholder layout, interleaving and positions stay transformers' own."""

    def __init__(self) -> None:
        self.merge_size = PREPROCESSOR_CONFIG["merge_size"]
        self.temporal_patch_size = PREPROCESSOR_CONFIG["temporal_patch_size"]

    def __call__(self, videos, **kwargs):
        done = [preprocess_video(frames, VideoProcessorConfig()) for frames in videos]
        return {
            "pixel_values_videos": PixelNorm.of(VideoProcessorConfig())(
                torch.cat([patches for patches, _ in done])
            ),
            "video_grid_thw": torch.tensor([grid for _, grid in done]),
        }


def tones(seconds: float, seed: int = 0) -> np.ndarray:
    n = round(seconds * 16000)
    t = np.arange(n) / 16000
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.4 * np.sin(2 * np.pi * 330 * t) + 0.05 * noise).astype(np.float32)


def speech() -> np.ndarray:
    waveform, rate = decode_audio(SPEECH.read_bytes())
    assert rate == 16000  # 47,676 samples: not whole hops, fine for the longest clip of a batch
    return waveform


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def audio(x: np.ndarray) -> dict:
    return {"type": "audio", "audio": x}


def image(x: Image.Image) -> dict:
    return {"type": "image", "image": x}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def media(messages: list[dict], kind: str) -> list | None:
    found = [
        p[kind] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == kind
    ]
    return found or None


def reference(hf_processor, prompt: str, messages: list[dict]):
    """transformers' processor on the same rendered prompt and media (one batch, as it is called)."""
    return hf_processor(
        text=prompt, audio=media(messages, "audio"), images=media(messages, "image"), return_tensors="pt"
    )


def clips_alone(hf_processor, ref, messages: list[dict]):
    """`ref` with each clip's mel computed on its own: transformers' padded batch lets a shorter clip's
    last frame see the zero padding of the batch instead of its own reflection, so its features depend on
    its neighbours; ours (and transformers' for a clip alone) do not."""
    clips = media(messages, "audio") or []
    if not clips:
        return ref
    features = ref["input_features"].clone().zero_()
    for i, clip in enumerate(clips):
        alone = hf_processor.feature_extractor(
            [clip],
            sampling_rate=16000,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(alone["attention_mask"].sum())
        assert frames == int(ref["feature_attention_mask"][i].sum())
        features[i, :, :frames] = alone["input_features"][0, :, :frames]
    return {**ref, "input_features": features}
