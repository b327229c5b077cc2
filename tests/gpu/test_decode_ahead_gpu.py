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
