"""Decoding ahead on a GPU over the tiny checkpoint: the decode graphs replay on the ids of the step in flight,
still on the device, and give the tokens of stepping one after the other, batched, seeded, stopped and
constrained (each grammar mask copied up while the forward pass runs)."""

import json

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.request import StructuredOutput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "JSON:"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


def test_decoding_ahead_replays_the_tokens_of_lockstep(tiny_checkpoint):
    common = dict(
        model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", page_size=4, kv_cache_memory_gib=0.05,
        max_graph_batch=8, compile=False,
    )  # fmt: skip
    ahead, lockstep = LLM(decode_ahead=True, **common), LLM(decode_ahead=False, **common)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = lockstep.generate(PROMPTS[1], greedy)[0].outputs[0].token_ids
    params = [
        greedy,
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[reference[9]]),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
        greedy,
        SamplingParams(
            max_tokens=100, temperature=0.0, structured=StructuredOutput(json_schema=json.dumps(SCHEMA))
        ),
    ]
    launches = []
    launch = ahead.engine._launch
    ahead.engine._launch = lambda chunks, previous: (
        launches.append(previous is not None) or launch(chunks, previous)
    )

    def run(llm):
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages and not llm.engine.has_unfinished()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    expected = run(lockstep)
    assert run(ahead) == expected
    assert expected[1][1] == "stop" and expected[4][1] == "stop"
    assert sum(launches) >= 15  # launched on the ids of the step in flight


def test_arrivals_each_step_launch_ahead_through_the_prefill_graphs(tiny_checkpoint):
    """A request arriving on every step: its prompt is prefilled beside the decode rows in a step launched
    ahead (a prefill graph, its decode rows' ids those of the step in flight), with lockstep's tokens."""
    common = dict(
        model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", page_size=4, kv_cache_memory_gib=0.05,
        max_graph_batch=16, max_num_seqs=16, compile=False,
    )  # fmt: skip
    ahead, lockstep = LLM(decode_ahead=True, **common), LLM(decode_ahead=False, **common)
    arrivals = [
        (f"r{i}", PROMPTS[i % 5] * (1 + i % 3), SamplingParams(max_tokens=8 + i % 5, temperature=0.0))
        for i in range(14)
    ]
    with_prompts = []
    launch = ahead.engine._launch
    ahead.engine._launch = lambda chunks, previous: (
        with_prompts.append(previous is not None and any(c.num_tokens > 1 for c in chunks))
        or launch(chunks, previous)
    )

    def run(llm):
        engine, tokens, pending = llm.engine, {}, list(arrivals)
        while pending or engine.has_unfinished():
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, engine.processor.encode(prompt), params)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        assert engine.pool.num_free == engine.pool.num_pages
        return tokens

    expected = run(lockstep)
    assert run(ahead) == expected
    assert sum(with_prompts) >= 5
    assert ahead.engine.runner.prefill_graphs is not None
