"""The realtime benchmark's client: a raw `websockets` connection to /v1/realtime whose events are stamped as
they arrive, each response's audio followed as it streams, and a microphone that sends chunks on the audio
timeline (silence between the utterances it is given)."""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.bench.realtime_turns import RATE, chunks, send_times

TIMEOUT_S = 120.0  # the longest wait for one event


@dataclass
class Reply:
    """One response as the client saw it (perf_counter times)."""

    first_audio: float | None = None
    last_audio: float | None = None
    audio_bytes: int = 0
    transcript: str = ""
    status: str = ""
    text_tokens: int = 0
    done_at: float | None = None
    speaking: asyncio.Event = field(default_factory=asyncio.Event)  # its first audio is in
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def audio_s(self) -> float:
        return self.audio_bytes / 2 / RATE


class Session:
    """One open realtime session: `until` waits for an event of a kind; `replies` follows every response."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: asyncio.Queue[tuple[float, dict[str, Any] | None]] = asyncio.Queue()
        self.replies: dict[str, Reply] = {}
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, url: str, session: dict[str, Any]) -> Session:
        """Connect to `url` (http://host:port) and set the session (as `session.update` does)."""
        import websockets

        ws_url = "ws" + url.removeprefix("http") + "/v1/realtime"
        ws = await websockets.connect(ws_url, max_size=None, compression=None, open_timeout=TIMEOUT_S)
        opened = cls(ws)
        await opened.until("session.created")
        await opened.send({"type": "session.update", "session": {"type": "realtime", **session}})
        await opened.until("session.updated")
        return opened

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                at = time.perf_counter()  # before parsing: the parse is the client's time, not the server's
                event = json.loads(frame)
                self._follow(at, event)
                self.events.put_nowait((at, event))
        finally:
            self.events.put_nowait((time.perf_counter(), None))

    def _follow(self, at: float, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.created":
            self.replies[event["response"]["id"]] = Reply()
        elif kind == "response.output_audio.delta":
            reply = self.replies[event["response_id"]]
            reply.first_audio = reply.first_audio or at
            reply.last_audio = at
            reply.speaking.set()
            reply.audio_bytes += len(base64.b64decode(event["delta"]))
        elif kind == "response.output_audio_transcript.delta":
            self.replies[event["response_id"]].transcript += event["delta"]
        elif kind == "response.done":
            body = event["response"]
            reply = self.replies[body["id"]]
            reply.done_at = at
            reply.status = body["status"]
            usage = body.get("usage") or {}
            reply.text_tokens = (usage.get("output_token_details") or {}).get("text_tokens", 0)
            reply.finished.set()

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str) -> tuple[float, dict[str, Any]]:
        """The next event of type `kind` and when it arrived; an `error` event or the end raises RuntimeError."""
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                at, event = await self.events.get()
                if event is None:
                    raise RuntimeError(f"the session closed before {kind}")
                if event["type"] == "error":
                    raise RuntimeError(f"error event: {event['error']}")
                if event["type"] == kind:
                    return at, event

    async def done(self, response_id: str) -> Reply:
        reply = self.replies[response_id]
        async with asyncio.timeout(TIMEOUT_S):
            await reply.finished.wait()
        return reply

    async def speaking(self, response_id: str) -> tuple[Reply, float]:
        """The response and when its first audio came, once it has (one that ends without: RuntimeError)."""
        reply = self.replies[response_id]
        waits = [asyncio.ensure_future(reply.speaking.wait()), asyncio.ensure_future(reply.finished.wait())]
        try:
            await asyncio.wait(waits, timeout=TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if reply.first_audio is None:
            raise RuntimeError(f"response {response_id} ({reply.status or 'still running'}) had no audio")
        return reply, reply.first_audio

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)


def append(pcm: bytes) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}


async def speak(session: Session, pcm: bytes, chunk_ms: int, pace: float) -> None:
    """`pcm` appended in chunks of `chunk_ms`, each once a microphone has recorded it, `pace` times faster
    than real time (0: all at once)."""
    pieces = chunks(pcm, chunk_ms)
    start = time.perf_counter()
    for piece, at in zip(pieces, send_times(len(pieces), chunk_ms, pace), strict=True):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        await session.send(append(piece))


class Microphone:
    """An open microphone in real time: a chunk every `chunk_ms`, silence unless `say` queued speech."""

    def __init__(self, session: Session, chunk_ms: int) -> None:
        self.session, self.chunk_ms = session, chunk_ms
        self.silence = bytes(RATE * chunk_ms // 1000 * 2)
        self.queued: collections.deque[bytes] = collections.deque()
        self.start = time.perf_counter()
        self.sent = 0  # chunks sent
        self.task = asyncio.ensure_future(self._run())

    def say(self, pcm: bytes) -> tuple[float, float]:
        """Queue `pcm` after what is queued; when, on the wall clock, its first and last sample are spoken
        (a chunk is spoken over the `chunk_ms` before it is sent)."""
        first = self.sent + len(self.queued)
        pieces = chunks(pcm, self.chunk_ms)
        self.queued.extend(pieces)
        seconds = self.chunk_ms / 1000
        return self.start + first * seconds, self.start + first * seconds + len(pcm) / 2 / RATE

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(
                max(0.0, self.start + (self.sent + 1) * self.chunk_ms / 1000 - time.perf_counter())
            )
            await self.session.send(append(self.queued.popleft() if self.queued else self.silence))
            self.sent += 1

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
