"""transformers' processor and thinker on the tiny checkpoint, built once per test module."""

from __future__ import annotations

import pytest
import torch
from media_samples import MEDIA_TOKENS, VideoProcessorStub
from transformers import (
    AutoTokenizer,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG


class ProcessorWithoutVideo(Qwen3OmniMoeProcessor):
    """transformers' processor, its class check letting the video stub through: 5.17 checks a video processor
    against BaseVideoProcessor (a dummy class without torchvision), 5.24 against VideoProcessorMixin, which it
    does not export at all without torchvision, so no stub could pass."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def hf_processor(tiny_checkpoint) -> Qwen3OmniMoeProcessor:
    audio_keys = (
        "feature_size",
        "sampling_rate",
        "hop_length",
        "chunk_length",
        "n_fft",
        "padding_value",
        "dither",
    )
    image_keys = (
        "min_pixels",
        "max_pixels",
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "image_mean",
        "image_std",
    )
    return ProcessorWithoutVideo(
        image_processor=Qwen2VLImageProcessorPil(**{k: PREPROCESSOR_CONFIG[k] for k in image_keys}),
        video_processor=VideoProcessorStub(),
        feature_extractor=WhisperFeatureExtractor(**{k: PREPROCESSOR_CONFIG[k] for k in audio_keys}),
        tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint, extra_special_tokens=MEDIA_TOKENS),
    )


@pytest.fixture(scope="module")
def hf_thinker(tiny_checkpoint):
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).thinker.eval()
