"""A streamed reply's outputs every `stream_interval` tokens: the first at once, the last with whatever is held,
the deltas between joined, so that the deltas still add up to the reply."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.config import engine_config
from omnistage.engine.output_processor import request_state
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.request import GenerationRequest, SpeechParams

PROMPT = "A long time ago in a galaxy far, far away there was a"
# 24 tokens, the logprobs of each: at an interval of 4, outputs of 1, 4, 4, 4, 4, 4 and 3 tokens
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def make_llm(checkpoint, **kwargs):
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=128, **kwargs)


@pytest.fixture(scope="module")
def every_token(tiny_checkpoint):
    """The reply with an output per token: the reference."""
    llm = make_llm(tiny_checkpoint)
    return _stream(llm, "ref", PARAMS)


def _stream(llm, request_id, params, steps=None):
    """Every output of one request stepped through the engine (`steps`: abort it after that many steps)."""
    engine = llm.engine
    engine.add_request(request_id, engine.processor.encode(PROMPT), params)
    outputs, step = [], 0
    while engine.has_unfinished():
        if steps is not None and step == steps:
            outputs.append(engine.abort(request_id))
            break
        outputs += [o for o in engine.step() if o.request_id == request_id]
        step += 1
    return outputs


def _joined(outputs):
    completions = [o.outputs[0] for o in outputs]
    return (
        [t for c in completions for t in c.delta_token_ids],
        "".join(c.delta_text for c in completions),
        [p for c in completions for p in c.delta_logprobs],
    )


def test_outputs_come_every_few_tokens_and_their_deltas_make_the_reply(tiny_checkpoint, every_token):
    outputs = _stream(make_llm(tiny_checkpoint, stream_interval=4), "a", PARAMS)
    assert [len(o.outputs[0].delta_token_ids) for o in outputs] == [1, 4, 4, 4, 4, 4, 3]
    assert [o.finished for o in outputs] == [False] * 6 + [True]
    final = outputs[-1].outputs[0]
    reference = every_token[-1].outputs[0]
    assert final.token_ids == reference.token_ids and len(final.token_ids) == 24
    assert final.text == reference.text and final.logprobs == reference.logprobs
    ids, text, logprobs = _joined(outputs)
    assert ids == final.token_ids and text == final.text and logprobs == final.logprobs
    # each output's cumulative fields are the reference's at the same token
    by_length = {len(o.outputs[0].token_ids): o.outputs[0] for o in every_token}
    for out in outputs:
        completion = out.outputs[0]
        assert completion.text == by_length[len(completion.token_ids)].text


def test_an_abort_carries_the_tokens_held(tiny_checkpoint, every_token):
    llm = make_llm(tiny_checkpoint, stream_interval=8)
    outputs = _stream(llm, "b", PARAMS, steps=6)
    last = outputs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0 < len(last.outputs[0].delta_token_ids) < 8  # the held tokens came with the abort
    ids, text, _ = _joined(outputs)
    assert ids == last.outputs[0].token_ids == every_token[-1].outputs[0].token_ids[: len(ids)]
    assert text == last.outputs[0].text
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_the_served_stream_joins_the_deltas(tiny_checkpoint, every_token):
    """Through the in-process server's AsyncPipeline, several requests at once."""
    engine = AsyncPipeline.from_config(
        engine_config(
            model=str(tiny_checkpoint),
            device="cpu",
            dtype="float32",
            page_size=4,
            num_kv_pages=128,
            stream_interval=3,
        )
    )
    ids = engine.pipeline.processor.encode(PROMPT)

    async def run(i):
        return [out async for out in engine.generate(GenerationRequest(str(i), ids, PARAMS, PROMPT))]

    async def main():
        return await asyncio.gather(*(run(i) for i in range(4)))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    reference = every_token[-1].outputs[0]
    for outputs in streams:
        assert len(outputs) == 1 + -(-23 // 3)  # the first token, then every 3
        assert _joined(outputs)[:2] == (reference.token_ids, reference.text)


def test_a_spoken_reply_feeds_the_talker_token_by_token(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, stream_interval=4)
    engine = llm.engine

    def state(speech):
        request = GenerationRequest("s", [1, 2, 3], PARAMS, speech=speech)
        return request_state(request, None, None, engine.tokenizer, [], torch.device("cpu"), None, 4)

    assert state(None).stream_interval == 4
    assert state(SpeechParams()).stream_interval == 1
