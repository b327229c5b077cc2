"""A final-only request (GenerationRequest.final_only) on the tiny checkpoint (CPU, float32): the stage builds
its finished output alone, equal to a streamed twin's last (text, ids, logprobs, finish reason), with a stop
string and with decoding ahead. (A spoken reply's Thinker keeps its outputs for the Talker: the speech case is
tests/server/test_final_only.py's.)"""

from __future__ import annotations

import pytest

from omnistage import LLM, SamplingParams
from omnistage.engine.stages.text_setup import NewRequest

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module", params=[False, True], ids=["lockstep", "ahead"])
def llm(tiny_checkpoint, request):
    return LLM(
        model=str(tiny_checkpoint), device="cpu", dtype="float32", num_kv_pages=64, decode_ahead=request.param
    )


def run(llm, params: SamplingParams) -> dict[str, list]:
    """A streamed request and its final-only twin, side by side: each one's outputs in order."""
    engine = llm.engine
    ids = engine.processor.encode(PROMPT)
    requests = [NewRequest("streamed", ids, params), NewRequest("final", ids, params, final_only=True)]
    assert engine.add_requests(requests) == [None, None]
    outputs: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.pool.num_free == engine.pool.num_pages
    return outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True),
    ],
    ids=["greedy-logprobs", "seeded"],
)
def test_only_the_last_output_is_built_and_it_is_the_streamed_ones(llm, params):
    outputs = run(llm, params)
    streamed, (final,) = outputs["streamed"], outputs["final"]
    assert len(streamed) == params.max_tokens and final.finished
    whole, last = final.outputs[0], streamed[-1].outputs[0]
    assert whole.token_ids == last.token_ids and whole.text == last.text
    assert whole.finish_reason == last.finish_reason == "length"
    if params.logprobs is not None:  # the two rows of one batch: equal up to float reduction order
        assert whole.logprobs is not None and last.logprobs is not None
        assert [p.token_id for p in whole.logprobs] == [p.token_id for p in last.logprobs]
        assert [p.logprob for p in whole.logprobs] == pytest.approx(
            [p.logprob for p in last.logprobs], abs=1e-4
        )


def test_a_stop_string_ends_it_where_it_ends_the_stream(llm):
    reference = run(llm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))["streamed"][-1]
    stop = reference.outputs[0].text[5:8]  # a piece of the greedy reply, found mid-way
    outputs = run(llm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))
    (final,) = outputs["final"]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == outputs["streamed"][-1].outputs[0].text
    assert len(outputs["streamed"]) > 1


def test_offline_generate_asks_for_final_outputs_alone(llm, monkeypatch):
    seen = []
    add_requests = llm.pipeline.add_requests
    monkeypatch.setattr(llm.pipeline, "add_requests", lambda rs: seen.extend(rs) or add_requests(rs))
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and [r.final_only for r in seen] == [True]
