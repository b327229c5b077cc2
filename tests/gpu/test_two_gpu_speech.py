"""The two-GPU topology on the tiny checkpoint: the Thinker on GPU 0, the speech stages on GPU 1 (hand-offs
cross devices); greedy speech equals the same on one GPU."""

from __future__ import annotations

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.attention import AttentionMetadata
from omnistage.engine.graphs import DecodeGraphs
from omnistage.kernels.gemv import graph_us

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
    two = LLM(stages={"talker": {"device": "cuda:1"}}, **common)
    assert two.pipeline.speech_stages.talker.codec_head.weight.device == torch.device("cuda", 1)
    assert two.engine.model.lm_head.weight.device == torch.device("cuda", 0)
    assert speak(two) == speak(LLM(**common))
    assert (
        two.pipeline.speech_stages.talker_stage.pool.num_free
        == two.pipeline.speech_stages.talker_stage.pool.num_pages
    )


def test_a_graph_set_captures_on_its_own_gpu_whatever_the_first_capture(monkeypatch):
    """torch.cuda.graph's default capture stream is made at the process's first capture, on the device then
    current: the released two-GPU start times the speech stages' GEMVs in graphs on GPU 1 first, and the
    Thinker's decode graphs on GPU 0 then failed to capture ("operation not permitted when stream is
    capturing"). A graph set captures on a stream of its own device, and replays equal eager."""
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    other = torch.ones(64, device="cuda:1")
    with torch.cuda.device(1):
        graph_us(lambda: other.mul(2))
    weight = torch.randn(32, 16, device="cuda:0")

    def step(ids, positions, meta):
        return (weight[ids] * positions[0, :, None] + meta.seq_lens[:, None]).sum(1)

    runner = DecodeGraphs(step, max_batch=8, max_pages=2, max_seq_len=32, device="cuda:0")
    assert runner.capture([1, 2, 4, 8]) == [1, 2, 4, 8]
    for batch in (1, 3, 8):
        ids = torch.arange(batch, device="cuda:0")
        positions = torch.arange(batch, device="cuda:0").expand(3, -1) + 5
        meta = AttentionMetadata.build([(5 + b, 1, [0, 1]) for b in range(batch)], 16, "cuda:0")
        assert torch.equal(runner.run(ids, positions, meta), step(ids, positions, meta))
