"""Speech out at the released sizes (random bf16 weights) on a GPU: one S2S request, then eight T2S
requests at once, each speaking exactly the frames forced, every stage's pages free afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from omnistage.bench import speech_targets as targets
from omnistage.bench.skeletons import released_skeleton
from omnistage.config import engine_config
from omnistage.outputs import AUDIO_SAMPLE_RATE
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams

pytestmark = pytest.mark.gpu

TEXT_TOKENS, FRAMES = 16, 50  # 4 s of audio


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncPipeline]:
    # eager and uncompiled: this checks what runs, not how fast (the benchmark runs the default settings)
    config = engine_config(
        model=str(released_skeleton()), load_format="dummy", device="cuda", dtype="bfloat16",
        enforce_eager=True, compile=False,
    )  # fmt: skip
    engine = AsyncPipeline.from_config(config)
    yield engine
    engine.shutdown()


def assert_pools_full(engine: AsyncPipeline) -> None:
    stats = engine.pipeline.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["talker_kv_pages_free"] == stats["talker_kv_pages_total"] > 0


def test_one_s2s_request(engine):
    item = targets.speech_inputs("s2s", espeak=False)[0]
    prompt = engine.frontend.processor.process_chat(item.messages())
    talker = targets.talker_params(FRAMES, forced=True)
    thinker = SamplingParams(**targets.text_fields(TEXT_TOKENS, forced=True))

    async def run():
        deltas, final = [], None
        speech = SpeechParams(voice="ethan", talker=talker)
        request = GenerationRequest(
            "s2s", prompt.token_ids, thinker, prompt.prompt, prompt.mrope, prompt.mm, speech
        )
        async for out in engine.generate(request):
            if out.audio_delta is not None:
                deltas.append(out.audio_delta)
            final = out
        return deltas, final

    deltas, final = asyncio.run(run())
    assert final.finished and final.error is None and final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == TEXT_TOKENS and final.num_audio_frames == FRAMES
    assert len(final.audio_codes) == FRAMES and len(deltas) > 1  # streamed in several chunks
    assert np.array_equal(np.concatenate(deltas), final.audio) and np.isfinite(final.audio).all()
    assert (
        0.9 * FRAMES / targets.FRAMES_PER_SECOND
        < len(final.audio) / AUDIO_SAMPLE_RATE
        <= FRAMES / targets.FRAMES_PER_SECOND
    )
    assert_pools_full(engine)


def test_eight_concurrent_t2s_requests(engine):
    run = targets.inprocess_runner(engine, False, TEXT_TOKENS, FRAMES, "chelsie", forced=True)
    inputs = targets.speech_inputs("t2s")

    async def together():
        return await asyncio.gather(*(run(inputs[i % len(inputs)], i) for i in range(8)))

    timings = asyncio.run(together())  # the runner raises on a failed request or other frame counts
    assert [(t.frames, t.text_tokens) for t in timings] == [(FRAMES, TEXT_TOKENS)] * 8
    assert all(0 < t.first_packet_s < t.latency_s for t in timings)
    assert all(0.9 * FRAMES / targets.FRAMES_PER_SECOND < t.audio_s for t in timings)
    assert_pools_full(engine)
