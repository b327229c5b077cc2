"""What the realtime tests share: the official SDK's client of a test server, the events up to one of a kind,
the user's "speech" (a tone, or a recorded utterance placed in silence), and the check that every page is free."""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from pathlib import Path

import numpy as np
import openai
import soundfile

from omnistage.bench.turn_clips import TurnClip, turn_clip
from omnistage.server.realtime.codecs import to_model_rate

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"

KEY = "sk-realtime"
INSTRUCTIONS = "You are a terse assistant."


def in_loop(test):
    """An async test run in an event loop of its own."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def tone(seconds: float, rate: int = 24_000, hz: float = 220.0) -> bytes:
    """A sine of `seconds` as pcm16 at `rate`: the user's 'speech'."""
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 0.3 * 32767).astype("<i2").tobytes()


def clip_of(pcm: bytes) -> np.ndarray:
    """The 16 kHz clip the processor reads of pcm16 at 24 kHz, as the session converts it."""
    return to_model_rate(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0, 24_000)


def connect(url: str, key: str = KEY, **query: str):
    """The SDK's realtime connection to the server at `url` (model "tiny", or `query` instead)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    if "intent" in query:
        return client.realtime.connect(extra_query=query)
    return client.realtime.connect(model=query.get("model", "tiny"))


async def until(conn, kind: str) -> list:
    """The events received up to and including the first of type `kind`."""
    events = []
    async with asyncio.timeout(120):
        async for event in conn:
            events.append(event)
            if event.type == kind:
                return events
    raise AssertionError(f"the connection closed before {kind}")


async def manual(conn, **session) -> None:
    """Turn detection off (the client commits), and the session's other settings."""
    assert (await conn.recv()).type == "session.created"
    audio = session.pop("audio", {})
    audio = audio | {"input": audio.get("input", {}) | {"turn_detection": None}}
    await conn.session.update(
        session={"type": "realtime", "instructions": INSTRUCTIONS, "audio": audio, **session}
    )
    (updated,) = await until(conn, "session.updated")
    assert updated.session.audio.input.turn_detection is None


async def pages_free(pipeline, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = pipeline.stats()
        if stats["kv_pages_used"] == 0 and stats["talker_kv_pages_free"] == stats["talker_kv_pages_total"]:
            return
        assert time.monotonic() < deadline, f"pages still held: {stats}"
        await asyncio.sleep(0.02)


def audio_bytes(events: list) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


def spoken_turns(silences_ms: tuple[int, ...], rate: int = 24_000) -> TurnClip:
    """The recorded utterance once per silence but the last, with those silences around it, at `rate`."""
    speech, speech_rate = soundfile.read(SPEECH, dtype="float32")
    gains = (1.0,) * (len(silences_ms) - 1)
    return turn_clip(speech, speech_rate, rate, silences_ms, gains)


async def stream(conn, audio: np.ndarray, rate: int = 24_000, chunk_ms: int = 100) -> None:
    """`audio` (float) appended as pcm16 in chunks, as a microphone sends it (not paced in real time)."""
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    step = rate * chunk_ms // 1000
    for at in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[at : at + step].tobytes()).decode())
