"""A request through AsyncPipeline is validated once: the pipeline's `validate` runs once per request, its stages'
checks inside it once each, and nothing after it checks the request again (tiny checkpoints, CPU)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omnistage import LLM, SamplingParams
from omnistage.config import engine_config
from omnistage.models.qwen3_asr.tiny import make_tiny as make_tiny_asr
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.family import build_pipeline
from omnistage.request import GenerationRequest, SpeechParams, talker_sampling_defaults

HELLO = [{"role": "user", "content": "Say hello."}]


def counting(counts: Counter, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return method(*args, **kwargs)

    return counted


def validations(pipeline: Any, request: GenerationRequest, monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How often `request`, run to its end through an AsyncPipeline, was checked by the pipeline and by its
    Thinker stage."""
    counts: Counter = Counter()
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "validate", counting(counts, "pipeline", pipeline.validate))
        patch.setattr(pipeline.thinker, "validate", counting(counts, "thinker", pipeline.thinker.validate))
        engine = AsyncPipeline(pipeline)

        async def run() -> None:
            async for out in engine.generate(request):
                assert out.error is None

        try:
            asyncio.run(run())
        finally:
            engine.shutdown()
    return counts


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4)


def test_a_text_and_a_spoken_request_are_validated_once(llm, monkeypatch):
    pipeline = llm.pipeline
    prompt = pipeline.processor.process_chat(HELLO)
    text = SamplingParams(max_tokens=3, temperature=0.0)
    talker = talker_sampling_defaults()
    talker.max_tokens = 4
    tts = pipeline.frontend.tts_prompt("Good morning.")
    requests = {
        "text": GenerationRequest("text", prompt.token_ids, text, prompt.prompt),
        "spoken": GenerationRequest(
            "spoken", prompt.token_ids, text, prompt.prompt, speech=SpeechParams("ethan", talker)
        ),
        "tts": GenerationRequest(
            "tts",
            tts.token_ids,
            SamplingParams(max_tokens=len(tts.reply_token_ids)),
            tts.prompt,
            speech=SpeechParams("ethan", talker, reply_token_ids=tts.reply_token_ids),
        ),
    }
    for name, request in requests.items():
        assert validations(pipeline, request, monkeypatch) == {"pipeline": 1, "thinker": 1}, name


def test_a_transcription_is_validated_once(tmp_path, monkeypatch):
    pipeline = build_pipeline(
        engine_config(model=str(make_tiny_asr(tmp_path)), device="cpu", num_kv_pages=64)
    )
    clip = np.zeros(8000, dtype=np.float32)
    laid_out = pipeline.processor.transcription(clip, None, None)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    request = GenerationRequest(
        "asr", laid_out.token_ids, params, laid_out.prompt, laid_out.mrope, laid_out.mm
    )
    assert validations(pipeline, request, monkeypatch) == {"pipeline": 1, "thinker": 1}


def test_a_prefill_leaves_its_prompts_pages_cached_for_the_turn_after_it(llm):
    """A turn's prompt prefilled before it is complete (a realtime session as audio arrives): the complete
    turn then finds every full page of the prefilled prompt cached, and replies as it would have anyway."""
    pipeline = llm.pipeline
    history = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there."}]
    partial = pipeline.processor.process_chat([*history, {"role": "user", "content": "Now count to"}])
    whole = pipeline.processor.process_chat([*history, {"role": "user", "content": "Now count to three."}])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    pipeline.thinker.prefix_caching = False  # the reference leaves no page cached
    try:
        expected = llm.generate({"prompt_token_ids": whole.token_ids}, greedy)[0].outputs[0].token_ids
    finally:
        pipeline.thinker.prefix_caching = True
    pool = pipeline.thinker.pool
    engine = AsyncPipeline(pipeline)

    async def run() -> tuple[int, list[int]]:
        await engine.prefill(GenerationRequest("early", partial.token_ids, greedy, partial.prompt))
        assert pool.num_used == 0 and pool.num_cached >= len(partial.token_ids) // pool.page_size
        before = pool.hit_tokens
        tokens: list[int] = []
        async for out in engine.generate(GenerationRequest("turn", whole.token_ids, greedy, whole.prompt)):
            tokens = out.outputs[0].token_ids  # each output holds every token so far
        return pool.hit_tokens - before, tokens

    try:
        found, tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    common = next(i for i, (a, b) in enumerate(zip(partial.token_ids, whole.token_ids)) if a != b)
    assert found == common // pool.page_size * pool.page_size
    assert tokens == expected
