"""The two-GPU topology on the tiny checkpoint: the Thinker on GPU 0, the speech stages on GPU 1 (hand-offs
cross devices); greedy speech equals the same on one GPU."""

from __future__ import annotations

import pytest
import torch

from omnistage import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def speak(llm: LLM) -> list:
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q in ("Say hello.", "Name a colour.")],
        SamplingParams(max_tokens=6, temperature=0.0),
        modalities=["text", "audio"],
        talker_params=SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True),
    )
    return [o.audio_codes for o in outs]


def test_speech_on_a_second_gpu_equals_one_gpu(tiny_checkpoint):
    common = dict(
        model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", kv_cache_memory_gib=0.05, compile=False
    )
    two = LLM(speech_device="cuda:1", **common)
    assert two.pipeline.speech_stages.talker.codec_head.weight.device == torch.device("cuda", 1)
    assert two.engine.model.lm_head.weight.device == torch.device("cuda", 0)
    assert speak(two) == speak(LLM(**common))
    assert (
        two.pipeline.speech_stages.talker_stage.pool.num_free
        == two.pipeline.speech_stages.talker_stage.pool.num_pages
    )
