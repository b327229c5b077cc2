"""Admitting requests with new clips and images on the GPU waits for nothing queued: the towers' inputs go up
through pinned memory, their graphs' buffers are filled the same way, the encoder cache's copy and the prefix
keys' copy of the rows go down behind the towers' work (host_rows.py). A wait there would idle the device
while the host prepares the next step, on every step that admits such a request."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.host_rows import copy_rows
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


def prompts(processor: Processor, seed: int) -> list:
    rng = np.random.default_rng(seed)
    contents = []
    for i, seconds in enumerate((0.8, 2.3, 4.7)):
        clip = (0.3 * rng.standard_normal(round(seconds * 16000))).astype(np.float32)
        content = [{"type": "audio", "audio": clip}]
        if i == 1:
            pixels = rng.integers(0, 256, (160, 224, 3), dtype=np.uint8)
            content.append({"type": "image", "image": Image.fromarray(pixels)})
        contents.append([{"role": "user", "content": content}])
    return [processor.process_chat(c) for c in contents]


def admit(stage: EncoderStage, batch: list) -> list:
    """What the admission does for new requests with media: encode them together, start the keys' copies."""
    embeds = stage.encode_many([(p.token_ids, p.mm) for p in batch])
    return [(e, copy_rows(e.audio_embeds, e.image_embeds)) for e in embeds]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@torch.no_grad()
def test_new_media_are_encoded_and_copied_without_waiting_for_the_device(tiny_checkpoint, graphs):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    device = torch.device("cuda")
    stage = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.bfloat16, device), cache_bytes=64 << 20)
    if graphs:
        stage.capture_graphs([1, 2, 4], [256], pool=torch.cuda.graph_pool_handle())
    processor = Processor(tiny_checkpoint)
    # a first admission of the same sizes loads the kernels (lazily, which may wait) and fills the caching
    # allocators, as a server's earlier steps do: what is timed is the steady state
    admit(stage, prompts(processor, 0))
    torch.cuda.synchronize()
    fresh = prompts(processor, 1)  # clips the encoder cache has not seen
    torch.cuda._sleep(2_000_000_000)  # ~1 s of clock cycles queued before the admission
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        admitted = admit(stage, fresh)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not queued.query(), "the admission waited for the work queued before it"
    assert not any(host.ready() for _, host in admitted)  # the copies are behind the sleep
    assert stage.cache.misses >= 3 + 3
    for p, (embeds, host) in zip(fresh, admitted):
        host.wait()
        assert torch.equal(host.audio, embeds.audio_embeds.cpu())
        assert (host.image is None) == (embeds.image_embeds is None)
        if host.image is not None:
            assert torch.equal(host.image, embeds.image_embeds.cpu())
        request = GenerationRequest("r", p.token_ids, SamplingParams(max_tokens=1), mrope=p.mrope)
        copied = request_keys(request, replace(embeds, host_rows=host), None, Runner())  # type: ignore[arg-type]
        read_back = request_keys(request, embeds, None, Runner())  # type: ignore[arg-type]
        assert copied.keys == read_back.keys
