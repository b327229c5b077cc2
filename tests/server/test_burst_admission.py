"""A burst of requests through the app, over the real engine (tiny checkpoint, CPU): while the server is still
preparing some of them, the idle engine holds those handed over and admits the burst as one batch (one encoder
pass, one prefill step; pipeline/step_loop.py). A lone request is admitted without waiting."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
import soundfile
from fastapi.testclient import TestClient

from omnistage.config import engine_config
from omnistage.models.qwen3_omni.code2wav import lookahead_samples
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server.app import build_app

MODEL = "tiny"


def test_a_burst_is_admitted_as_one_batch_and_a_lone_request_at_once(tiny_pipeline, monkeypatch):
    pipeline = tiny_pipeline.pipeline
    add_requests = pipeline.add_requests
    batches = []
    monkeypatch.setattr(
        pipeline, "add_requests", lambda requests: batches.append(len(requests)) or add_requests(requests)
    )
    send = tiny_pipeline._send
    coming = []  # each Add's count of requests still being prepared when it was sent
    monkeypatch.setattr(
        tiny_pipeline, "_send", lambda c: coming.append(getattr(c, "more_coming", None)) or send(c)
    )
    app = build_app(tiny_pipeline, MODEL)

    async def ask(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 2}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text

    async def burst(count: int) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await asyncio.gather(*(ask(client, i) for i in range(count)))

    asyncio.run(burst(4))
    assert batches == [4]
    adds = [c for c in coming if c is not None]
    assert len(adds) == 4 and adds[0] > 0 and adds[-1] == 0  # the first was held for the others
    batches.clear()
    coming.clear()
    asyncio.run(burst(1))
    assert batches == [1] and coming == [0]  # nothing else was being prepared: not held


# -- speaking requests: at most max_num_speaking in flight, the rest waiting their turn ------------------

FRAMES = 80  # each speech is forced to exactly this many codec frames (random weights never say the end)
SAMPLES_PER_FRAME = 24000 * 2 // 25


@pytest.fixture(scope="module")
def speaking_pipeline(tiny_checkpoint) -> Iterator[AsyncPipeline]:
    """Two speaking at once; the Talker's pool holds 768 tokens, so longer speech is refused at admission."""
    config = engine_config(
        model=str(tiny_checkpoint),
        device="cpu",
        num_kv_pages=64,
        max_num_speaking=2,
        stages={"talker": {"num_kv_pages": 48}},
    )
    engine = AsyncPipeline.from_config(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def speech_body(seed: int, frames: int = FRAMES) -> dict:
    forced = {"max_frames": frames, "min_frames": frames, "ignore_eos": True}
    body = {"model": MODEL, "input": "Hello there.", "voice": "ethan", "response_format": "wav", "seed": seed}
    return body | forced


def assert_nothing_held(engine: AsyncPipeline) -> None:
    """Every page of every stage is free again and no per-request state is left behind."""
    pipeline = engine.pipeline
    talker = pipeline.speech_stages.talker_stage
    assert not pipeline.has_unfinished()
    assert pipeline.thinker.pool.num_free == pipeline.thinker.pool.num_pages
    assert talker.pool.num_free == talker.pool.num_pages
    assert not pipeline._speaking and not pipeline.queue and not pipeline.queue.refused
    assert not talker.scheduler._unfinished and not pipeline.speech_stages.streamer.streams
    assert not engine._streams and engine._queued() == 0


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for `condition`, failing the test (not hanging it) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come about in time"
        await asyncio.sleep(0.005)


def wait_idle(engine: AsyncPipeline, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.pipeline.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_text_chat_is_not_queued_behind_long_speeches(speaking_pipeline):
    """Four speeches with two speaking at a time: the later two wait (counted as waiting), a short chat
    meanwhile finishes within a small part of their time, and every speech comes back whole."""
    app = build_app(speaking_pipeline, MODEL)
    pipeline = speaking_pipeline.pipeline
    seen = {"speaking": 0, "waiting": 0}
    finished: dict[int, float] = {}

    async def speak(client: httpx.AsyncClient, i: int) -> bytes:
        # they arrive in their order
        await until(lambda: len(pipeline._speaking) + len(pipeline.queue) + len(finished) >= i)
        response = await client.post("/v1/audio/speech", json=speech_body(seed=i))
        assert response.status_code == 200, response.text
        finished[i] = time.monotonic()
        return response.content

    async def watch() -> None:
        while len(finished) < 4:
            stats = speaking_pipeline.stats()
            seen["speaking"] = max(seen["speaking"], stats["num_speaking"])
            seen["waiting"] = max(seen["waiting"], stats["num_waiting"])
            await asyncio.sleep(0.01)

    async def chat(client: httpx.AsyncClient) -> float:
        await until(lambda: pipeline.stats()["num_speaking"] >= 2)  # the speeches are under way
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        start = time.monotonic()
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return time.monotonic() - start

    async def main() -> tuple[list[bytes], float, float]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        ) as client:
            start = time.monotonic()
            *audio, latency, _ = await asyncio.gather(
                *(speak(client, i) for i in range(4)), chat(client), watch()
            )
            return audio, latency, time.monotonic() - start

    audio, chat_latency, speech_time = asyncio.run(main())
    assert seen["speaking"] == 2 and seen["waiting"] >= 2  # the chat may be seen waiting for its prefill too
    assert chat_latency < speech_time / 5, (chat_latency, speech_time)
    # first come, first served: the two that waited end after the two that spoke first
    assert max(finished[0], finished[1]) < min(finished[2], finished[3])
    lookahead = lookahead_samples(Qwen3OmniConfig.from_dir(pipeline.model_path).code2wav)
    for data in audio:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert rate == 24000 and len(samples) == FRAMES * SAMPLES_PER_FRAME - lookahead
        assert np.abs(samples).max() > 0
    wait_idle(speaking_pipeline)
    assert_nothing_held(speaking_pipeline)


def test_a_full_queue_is_503_with_retry_after(speaking_pipeline, monkeypatch):
    """Two speaking and one waiting fill a queue of one: the next request (speech or text) is a 503 that
    says when to come back; the three still finish."""
    app = build_app(speaking_pipeline, MODEL)
    pipeline = speaking_pipeline.pipeline
    monkeypatch.setattr(speaking_pipeline, "max_queue", 1)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        ) as client:
            running = []
            for i in range(3):  # each once the one before is in: none meets a queue still holding another
                running.append(asyncio.ensure_future(client.post("/v1/audio/speech", json=speech_body(i))))
                await until(lambda n=i + 1: len(pipeline._speaking) + len(pipeline.queue) >= n)
            assert speaking_pipeline.stats()["num_waiting"] == 1
            refused = [
                await client.post("/v1/audio/speech", json=speech_body(9)),
                await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                ),
            ]
            return refused + list(await asyncio.gather(*running))

    *refused, a, b, c = asyncio.run(main())
    for response in refused:
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
    assert [r.status_code for r in (a, b, c)] == [200, 200, 200]
    wait_idle(speaking_pipeline)
    assert_nothing_held(speaking_pipeline)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/audio/speech", {"input": "Hello there.", "max_frames": 1000}, "max_frames"),
        ("/v1/audio/speech", {"input": " ".join(["word"] * 120)}, "input"),
        ("/v1/chat/completions", {"audio": {"max_frames": 1000}}, "audio.max_frames"),
        ("/v1/chat/completions", {"max_tokens": 100}, "max_tokens"),
    ],
)
def test_speech_beyond_the_talkers_pool_names_its_field(speaking_pipeline, path, body, param):
    """The Talker's pool (768 tokens) cannot hold the prompt and the frame cap: refused at admission, naming
    the field that set the cap (max_frames, else the text's length)."""
    client = TestClient(build_app(speaking_pipeline, MODEL))
    if path == "/v1/audio/speech":
        request = {"model": MODEL, "voice": "ethan"} | body
    else:
        audio = {"voice": "ethan", "format": "wav"} | body.pop("audio", {})
        messages = [{"role": "user", "content": "Hi"}]
        request = {
            "model": MODEL,
            "messages": messages,
            "modalities": ["text", "audio"],
            "audio": audio,
        } | body
    response = client.post(path, json=request)
    assert response.status_code == 400, response.text
    assert "pool has 48 pages" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param
    assert_nothing_held(speaking_pipeline)
