"""Qwen3-ASR on a GPU: the tiny checkpoint's graphs equal eager, and the released 0.6B sizes (random bf16
weights) transcribe a batch of clips with the Thinker's engine machinery (graphs, plan, pages back)."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import LLM, SamplingParams
from omnistage.bench.skeletons import released_skeleton
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.models.qwen3_asr.tiny import make_tiny

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True)


def clip(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.4 * np.sin(2 * np.pi * 220 * t) + 0.05 * noise).astype(np.float32)


def transcribe(llm: LLM, seconds: list[float]) -> list[list[int]]:
    processor = llm.pipeline.processor
    prompts = [processor.transcription(clip(s, i), None, None) for i, s in enumerate(seconds)]
    requests = [
        NewRequest(str(i), p.token_ids, GREEDY, p.prompt, p.mrope, p.mm) for i, p in enumerate(prompts)
    ]
    outs = llm._run(llm._admit(requests))
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_graphs_equal_eager(tmp_path):
    common = dict(
        model=str(make_tiny(tmp_path / "asr")), dtype="bfloat16", kv_cache_memory_gib=0.05, compile=False
    )
    graphs, eager = LLM(device="cuda", **common), LLM(device="cuda", enforce_eager=True, **common)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert transcribe(graphs, [1.0, 7.0, 9.0]) == transcribe(eager, [1.0, 7.0, 9.0])


def test_released_0p6b_transcribes_a_batch():
    llm = LLM(str(released_skeleton("qwen3-asr-0.6b")), load_format="dummy", device="cuda", dtype="bfloat16")
    assert "Qwen3-ASR" in llm.pipeline.memory_summary() and llm.engine.plan is not None
    replies = transcribe(llm, [1.0, 5.0, 31.0, 120.0])
    assert [len(r) for r in replies] == [12] * 4
