"""A voice conversation's earlier clips on the GPU: a prompt whose clips the encoder cache keeps is encoded and
keyed for the prefix cache without one wait on the device (each would stall admission until every queued step
ran), and gives the rows it gave the first time."""

import numpy as np
import pytest
import torch

from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.prefix import request_keys
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.qwen3_omni_encoders import load_encoders
from omnistage.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu


class Runner:
    """What request_keys reads of a token runner: its page size, and that it keeps no tapped rows."""

    page_size = 16
    keep_taps = False
    tap_layer = None


def keyed_twice(stage: EncoderStage, p):
    """The prompt `p` encoded and keyed, then again with any wait on the device an error: (embeds, keys, embeds
    again, keys again)."""
    request = GenerationRequest("r", p.token_ids, SamplingParams(max_tokens=1), mrope=p.mrope)
    first = stage.encode(p.token_ids, p.mm)
    keys = request_keys(request, first, None, Runner()).keys  # type: ignore[arg-type]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = stage.encode(p.token_ids, p.mm)
        again_keys = request_keys(request, again, None, Runner()).keys  # type: ignore[arg-type]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return first, keys, again, again_keys


def test_kept_clips_are_encoded_and_keyed_without_waiting_for_the_device(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    device = torch.device("cuda")
    towers = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, device))
    stage = EncoderStage(towers.audio_encoder, towers.audio, device, cache_bytes=64 << 20)
    processor = Processor(tiny_checkpoint)
    t = np.arange(8000) / 16000
    clips = [(0.3 * np.sin(2 * np.pi * f * t)).astype(np.float32) for f in (300.0, 450.0)]
    p = processor.process_chat([{"role": "user", "content": [{"type": "audio", "audio": c} for c in clips]}])
    first, keys, again, again_keys = keyed_twice(stage, p)
    assert stage.cache.hits == 2 and again_keys == keys
    assert torch.equal(again.audio_embeds, first.audio_embeds)


def test_a_kept_video_is_encoded_and_keyed_without_waiting_for_the_device(tiny_checkpoint):
    # a chat's video sent again: its vision rows and deepstack levels come back from pinned host memory, bit
    # for bit, the tower not run and nothing waited for
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    device = torch.device("cuda")
    towers = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.bfloat16, device))
    stage = EncoderStage(
        towers.audio_encoder, towers.audio, device, towers.vision_encoder, towers.images, towers.videos,
        cache_bytes=64 << 20,
    )  # fmt: skip
    video = np.random.default_rng(0).integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)
    p = Processor(tiny_checkpoint).process_chat(
        [{"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "What?"}]}]
    )
    first, keys, again, again_keys = keyed_twice(stage, p)
    assert (stage.cache.hits, stage.cache.misses) == (1, 1) and again_keys == keys
    assert torch.equal(again.image_embeds, first.image_embeds) and torch.equal(
        again.deepstack, first.deepstack
    )
