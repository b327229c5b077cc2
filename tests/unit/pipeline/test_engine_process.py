"""The pipeline in an engine process of its own, against the same pipeline on a thread (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from omnistage.config import engine_config
from omnistage.engine.sampling import SamplingParams, SpeechParams, talker_sampling_defaults
from omnistage.errors import ConfigError, InvalidRequest
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.async_engine import AsyncEngine
from omnistage.pipeline.engine_process import RemoteOutputs

TEXT = SamplingParams(max_tokens=7, temperature=0.8, seed=11)
TALKER = SamplingParams(**{**vars(talker_sampling_defaults()), "max_tokens": 9, "min_tokens": 9, "seed": 5})


def config(checkpoint):
    return engine_config(model=str(checkpoint), device="cpu", dtype="float32", num_kv_pages=256)


async def collect(engine: AsyncEngine, request_id: str, messages: list[dict], speech: SpeechParams | None):
    processor = engine.engine.processor
    prompt = processor.process_chat(messages)
    return [
        o async for o in engine.generate(request_id, prompt.prompt, prompt.token_ids, TEXT, speech=speech)
    ]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    here = AsyncEngine.from_config(config(tiny_checkpoint))
    there = AsyncEngine.from_config(config(tiny_checkpoint), engine_process=True)
    yield here, there
    here.shutdown()
    there.shutdown()


def test_outputs_equal_the_thread_engine_and_the_pools_are_full_after(engines):
    """Text deltas and cumulative fields rebuilt from the slim messages, spoken audio and codes: identical."""
    here, there = engines
    messages = [{"role": "user", "content": "Say something."}]
    speech = SpeechParams("aiden", TALKER)

    async def both():
        return await collect(here, "a", messages, speech), await collect(there, "a", messages, speech)

    ours, theirs = asyncio.run(both())
    assert len(ours) == len(theirs)
    for mine, remote in zip(ours, theirs):
        assert mine.outputs[0].text == remote.outputs[0].text
        assert mine.outputs[0].token_ids == remote.outputs[0].token_ids
        assert mine.outputs[0].delta_text == remote.outputs[0].delta_text
        assert mine.prompt_token_ids == remote.prompt_token_ids and mine.finished == remote.finished
        assert (mine.audio_delta is None) == (remote.audio_delta is None)
    assert theirs[-1].audio_codes == ours[-1].audio_codes and len(ours[-1].audio_codes) == 9
    # the engine process runs one intra-op thread, this one more: convolutions sum in another order
    np.testing.assert_allclose(theirs[-1].audio, ours[-1].audio, atol=1e-3 * np.abs(ours[-1].audio).max())
    stats = there.stats()
    assert (
        stats["kv_pages_free"] == stats["kv_pages_total"]
        and stats["num_waiting"] == stats["num_running"] == 0
    )
    assert stats["talker_kv_pages_free"] == stats["talker_kv_pages_total"]


def test_admission_errors_and_a_client_leaving(engines):
    _, there = engines

    async def refused():
        await collect(there, "bad", [{"role": "user", "content": "Hi"}], SpeechParams("nobody"))

    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'"):
        asyncio.run(refused())

    async def leave():
        prompt = there.engine.processor.process_chat([{"role": "user", "content": "Talk for a while."}])
        stream = there.generate("leaver", prompt.prompt, prompt.token_ids, SamplingParams(max_tokens=500))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(leave())
    deadline = time.monotonic() + 5
    while there.stats()["kv_pages_used"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert there.stats()["kv_pages_used"] == 0  # the stats came back without another step


def test_a_checkpoint_that_cannot_load_fails_the_start(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):
        AsyncEngine.from_config(engine_config(model=str(tmp_path), device="cpu"), engine_process=True)


def test_the_engine_process_dying_fails_open_streams_and_readiness(tiny_checkpoint):
    engine = AsyncEngine.from_config(config(tiny_checkpoint), engine_process=True)
    try:
        assert engine.ready

        async def cut_short():
            prompt = engine.engine.processor.process_chat([{"role": "user", "content": "Talk."}])
            stream = engine.generate("x", prompt.prompt, prompt.token_ids, SamplingParams(max_tokens=3000))
            await anext(stream)
            os.kill(engine._process.process.pid, signal.SIGKILL)
            async for _ in stream:
                pass

        with pytest.raises(RuntimeError, match="engine process exited"):
            asyncio.run(cut_short())
        assert not engine.ready
    finally:
        engine.shutdown()


def test_remote_outputs_rebuild_the_cumulative_fields():
    def out(delta: str, ids: list[int], finished: bool = False, **kw) -> RequestOutput:
        completion = CompletionOutput(
            0, kw.pop("text", ""), kw.pop("token_ids", []), delta_text=delta, delta_token_ids=ids
        )
        return RequestOutput(
            "r", kw.pop("prompt", None), kw.pop("prompt_token_ids", []), [completion], finished
        )

    rebuild = RemoteOutputs().rebuild
    first = rebuild("r", out("He", [1], prompt="p", prompt_token_ids=[7, 8]))
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.prompt_token_ids) == ("He", [1], [7, 8])
    second = rebuild("r", out("llo", [2]))
    assert (second.outputs[0].text, second.outputs[0].token_ids, second.prompt) == ("Hello", [1, 2], "p")
    final = rebuild("r", out("!", [3], True, text="Hello!", token_ids=[1, 2, 3]))
    assert (final.outputs[0].text, final.prompt_token_ids) == ("Hello!", [7, 8])
