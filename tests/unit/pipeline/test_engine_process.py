"""The pipeline in an engine process of its own, against the same pipeline on a thread (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from omnistage.config import engine_config
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.errors import ConfigError, InvalidRequest
from omnistage.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.engine_process import RemoteOutputs, SlimOutputs
from omnistage.pipeline.family import build_pipeline
from omnistage.pipeline.step_loop import Abort, Add, StepLoop
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams, talker_sampling_defaults

TEXT = SamplingParams(max_tokens=7, temperature=0.8, seed=11)
TALKER = SamplingParams(**{**vars(talker_sampling_defaults()), "max_tokens": 9, "min_tokens": 9, "seed": 5})


def config(checkpoint):
    return engine_config(model=str(checkpoint), device="cpu", dtype="float32", num_kv_pages=256)


async def collect(
    engine: AsyncPipeline,
    request_id: str,
    messages: list[dict],
    speech: SpeechParams | None,
    final_only: bool = False,
):
    processor = engine.frontend.processor
    prompt = processor.process_chat(messages)
    request = GenerationRequest(
        request_id, prompt.token_ids, TEXT, prompt.prompt, speech=speech, final_only=final_only
    )
    return [o async for o in engine.generate(request)]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    here = AsyncPipeline.from_config(config(tiny_checkpoint))
    there = AsyncPipeline.from_config(config(tiny_checkpoint), engine_process=True)
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


def test_a_final_only_request_gets_the_streamed_ones_last_output_alone(engines):
    """In the engine process as on the thread, spoken and not: one output, the streamed twin's last."""
    here, there = engines
    messages = [{"role": "user", "content": "Say something."}]
    speech = SpeechParams("aiden", TALKER)

    async def run(engine, speaks):
        streamed = await collect(engine, "s", messages, speaks)
        return streamed[-1], await collect(engine, "f", messages, speaks, final_only=True)

    for engine in (here, there):
        for speaks in (None, speech):
            last, final = asyncio.run(run(engine, speaks))
            assert len(final) == 1 and final[0].finished
            (whole,) = final
            assert (
                whole.outputs[0].text == last.outputs[0].text
                and whole.prompt_token_ids == last.prompt_token_ids
            )
            assert whole.outputs[0].token_ids == last.outputs[0].token_ids
            if speaks is not None:
                assert whole.audio_codes == last.audio_codes and len(whole.audio_codes) == 9
                assert (
                    whole.audio is not None and last.audio is not None and len(whole.audio) == len(last.audio)
                )


def test_admission_errors_and_a_client_leaving(engines):
    _, there = engines

    async def refused():
        await collect(there, "bad", [{"role": "user", "content": "Hi"}], SpeechParams("nobody"))

    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'"):
        asyncio.run(refused())

    async def leave():
        prompt = there.frontend.processor.process_chat([{"role": "user", "content": "Talk for a while."}])
        stream = there.generate(
            GenerationRequest("leaver", prompt.token_ids, SamplingParams(max_tokens=500), prompt.prompt)
        )
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
        AsyncPipeline.from_config(engine_config(model=str(tmp_path), device="cpu"), engine_process=True)


def test_the_engine_process_dying_fails_open_streams_and_readiness(tiny_checkpoint):
    engine = AsyncPipeline.from_config(config(tiny_checkpoint), engine_process=True)
    try:
        assert engine.ready

        async def cut_short():
            prompt = engine.frontend.processor.process_chat([{"role": "user", "content": "Talk."}])
            stream = engine.generate(
                GenerationRequest("x", prompt.token_ids, SamplingParams(max_tokens=3000), prompt.prompt)
            )
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


@pytest.mark.parametrize("asked", [True, False])
def test_slim_outputs_rebuild_into_the_engines_logprobs(asked):
    """The slim messages drop the cumulative logprobs of a running request; its deltas rebuild them."""
    steps = [TokenLogprobs(t, -0.1 * t, ((t, -0.1 * t), (9, -3.0))) for t in (1, 2, 3)]
    sent = []
    for n in range(1, 4):
        completion = CompletionOutput(
            0,
            "abc"[:n],
            [1, 2, 3][:n],
            delta_text="abc"[n - 1],
            delta_token_ids=[n],
            logprobs=steps[:n] if asked else None,
            delta_logprobs=steps[n - 1 : n] if asked else [],
        )
        sent.append(RequestOutput("r", "p", [7], [completion], finished=n == 3))
    slim, remote = SlimOutputs(), RemoteOutputs()
    for original in sent:
        [(_, item)] = slim.slim([("r", original)])
        if not original.finished:
            assert item.outputs[0].logprobs == ([] if asked else None)
        rebuilt = remote.rebuild("r", item)
        assert rebuilt.outputs[0] == original.outputs[0]


def test_aborted_requests_leave_no_bookkeeping_on_either_side(engines):
    """Streams that stop iterating or are cancelled mid-stream, beside streams that finish: afterwards no
    request's partial output is kept on the server's side, and every page is back (on a thread too)."""
    long = SamplingParams(max_tokens=400, min_tokens=400, seed=3)
    short = SamplingParams(max_tokens=5, min_tokens=5, seed=4)

    async def run(engine: AsyncPipeline) -> None:
        prompt = engine.frontend.processor.process_chat([{"role": "user", "content": "Talk for a while."}])

        async def leave(request_id: str, after: int) -> None:
            stream = engine.generate(GenerationRequest(request_id, prompt.token_ids, long, prompt.prompt))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == after:
                    break
            await stream.aclose()

        async def finish(request_id: str) -> None:
            outputs = [
                o
                async for o in engine.generate(
                    GenerationRequest(request_id, prompt.token_ids, short, prompt.prompt)
                )
            ]
            assert outputs[-1].finished

        async def cancelled(request_id: str) -> None:
            streaming = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate(
                    GenerationRequest(request_id, prompt.token_ids, long, prompt.prompt)
                ):
                    streaming.set()

            task = asyncio.create_task(consume())
            await streaming.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        await asyncio.gather(leave("l1", 1), leave("l3", 3), finish("f1"), finish("f2"), cancelled("c1"))

    for engine in engines:
        asyncio.run(run(engine))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            engine.stats()["kv_pages_used"]
            or (engine._process is not None and engine._process.outputs._partial)
        ):
            time.sleep(0.02)
        stats = engine.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["kv_pages_used"] == 0
        assert stats["num_waiting"] == stats["num_running"] == 0
        assert not engine._streams
        if engine._process is None:
            assert not engine.pipeline.has_unfinished()
        else:
            assert engine._process.outputs._partial == {}


def test_the_engine_side_keeps_nothing_of_aborted_requests(tiny_checkpoint):
    """What the engine process runs (a StepLoop delivering through SlimOutputs), here on this thread, its
    deliveries rebuilt by RemoteOutputs: aborted mid-stream, waiting or held, no request is kept on either side."""
    pipeline = build_pipeline(config(tiny_checkpoint))
    slim, remote = SlimOutputs(), RemoteOutputs()
    got: dict[str, list[RequestOutput]] = {}

    def deliver(items):
        for request_id, item in slim.slim(items):
            got.setdefault(request_id, []).append(remote.rebuild(request_id, item))

    prompt = pipeline.processor.process_chat([{"role": "user", "content": "Talk for a while."}])
    long, short = SamplingParams(max_tokens=400, min_tokens=400), SamplingParams(max_tokens=4, min_tokens=4)

    def add(request_id: str, params: SamplingParams) -> Add:
        return Add(NewRequest(request_id, prompt.token_ids, params, prompt.prompt))

    loop = StepLoop(pipeline, deliver)
    loop.handle([add("a", long), add("b", long), add("f", short)])
    for _ in range(3):
        loop.step()
    loop.handle([add("waiting", long)])
    loop.handle([Abort("a"), Abort("waiting"), add("held", long), Abort("held")])
    while not got["f"][-1].finished:
        loop.step()
    loop.handle([Abort("b"), Abort("f"), Abort("unknown")])
    while pipeline.has_unfinished():
        loop.step()
    assert slim._sent_prompt == set() and remote._partial == {}
    assert got["f"][-1].finished and got["f"][-1].outputs[0].finish_reason == "length"
    for request_id in "a", "b", "waiting":  # the abort's output, whole: the deltas so far, the prompt
        *streamed, last = got[request_id]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert last.outputs[0].token_ids == [t for o in streamed for t in o.outputs[0].delta_token_ids]
        assert last.prompt_token_ids == prompt.token_ids
    assert "held" not in got
    stats = pipeline.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_failed_request_leaves_nothing_on_either_side():
    """A request that fails after its first output (the engine loop's own error fails all it runs): its error
    ends its entries in SlimOutputs and RemoteOutputs alike."""
    completion = CompletionOutput(0, "He", [1], delta_text="He", delta_token_ids=[1])
    slim, remote = SlimOutputs(), RemoteOutputs()
    for items in [[("r", RequestOutput("r", "p", [7, 8], [completion], False))], [("r", RuntimeError("x"))]]:
        for request_id, item in slim.slim(items):
            remote.rebuild(request_id, item)
    assert slim._sent_prompt == set() and remote._partial == {}
