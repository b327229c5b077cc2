"""A prompt's prefix-cache keys over encoder rows on the GPU: the keys the same rows give on the host, and no
memory taken on the device to compute them (admission runs outside the memory plan)."""

import numpy as np
import pytest
import torch

from omnistage.engine.stages.encoders import MultimodalEmbeds
from omnistage.engine.stages.prefix import request_keys
from omnistage.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu


def embeds(device: str, audio: torch.Tensor, vision: torch.Tensor, levels: torch.Tensor) -> MultimodalEmbeds:
    audio_at = np.arange(4, 4 + audio.shape[0])
    vision_at = np.arange(audio_at[-1] + 3, audio_at[-1] + 3 + vision.shape[0])
    return MultimodalEmbeds(
        torch.from_numpy(audio_at).to(device),
        audio.to(device),
        torch.from_numpy(vision_at).to(device),
        vision.to(device),
        levels.to(device),
        audio_at,
        vision_at,
    )


class Runner:
    """What request_keys reads of a token runner: its page size, and that it keeps no tapped rows."""

    page_size = 16
    keep_taps = False
    tap_layer = None


def keys(prompt: list[int], mm: MultimodalEmbeds) -> list[bytes]:
    request = GenerationRequest("r", prompt, SamplingParams(max_tokens=1))
    return request_keys(request, mm, None, Runner()).keys  # type: ignore[arg-type]


def test_keys_over_rows_on_the_gpu_equal_the_hosts_and_allocate_nothing():
    gen = torch.Generator().manual_seed(0)
    audio = torch.randn(300, 2048, generator=gen).bfloat16()
    vision = torch.randn(4096, 2048, generator=gen).bfloat16()
    levels = torch.randn(
        3, 4096, 2048, generator=gen
    ).bfloat16()  # 48 MiB of deepstack levels beside the rows
    prompt = [7] * (4 + 300 + 3 + 4096 + 5)
    on_host = keys(prompt, embeds("cpu", audio, vision, levels))
    mm = embeds("cuda", audio, vision, levels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    on_gpu = keys(prompt, mm)
    assert torch.cuda.max_memory_allocated() == before
    assert on_gpu == on_host and len(on_gpu) == len(prompt) // 16
    vision[2000, 5] += 1  # a vision row's value is part of its page's key
    changed = keys(prompt, embeds("cpu", audio, vision, levels))
    page = (4 + 300 + 3 + 2000) // 16
    assert changed[:page] == on_host[:page] and changed[page] != on_host[page]
