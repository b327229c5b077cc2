"""Realtime voice sessions against one `omnistage serve`, timed from the user's end of speech to the first
audio packet, with barge-in, beside the same turns as plain chat requests.

    python -m omnistage.bench.realtime --out-dir OUT [--concurrency 1,8,32] [--serve-args "..."]

1. Manual commit, per concurrency c: c sessions at once (started `--stagger-s` apart in all, so that their
   commits do not all land in one step), each `--turns` turns of a `--utterance-s` utterance sent in 100 ms
   chunks at `--pace` times real time (1: the microphone's pace, which gives the server's prefill while the
   user speaks the time it has with a real user), then `input_audio_buffer.commit` and `response.create`.
   Measured: the commit sent to the first `response.output_audio.delta` received. Between turns the user
   hears the reply out (its audio at real time from its first packet) and pauses for a time drawn from
   [0, `--think-s`] (seeded per session and turn), as people apart do. With `--no-listen` each turn starts
   at the last one's `response.done`: replies admitted in one step end together, so the sessions' turns
   fall into lockstep, and by turn 5 all c end in the same step (benchmarks/RESULTS.md, "Realtime
   sessions, a third time").
2. Server VAD, one session: an utterance then silence, in 20 ms chunks at real time from an open microphone;
   measured: `input_audio_buffer.speech_stopped` received to the first audio delta. While that reply streams,
   `--barge-ins` times, the user speaks again (`--barge-after-s` after its first audio): measured, to the last
   audio delta of the reply cut off (status cancelled), from `speech_started` received, and from the speech's
   start on the audio timeline (which also counts the detector's delay and the chunk's 20 ms).
3. Baseline: turn 1's and turn `--turns`'s whole conversation (the recorded replies' text between the user's
   turns) as one streamed /v1/chat/completions request each, c at once per concurrency, with no caching: a
   system prompt that starts with a nonce (so that no page of the prompt is in the prefix cache) and fresh
   dither on the audio (so that the audio tower's cache holds none of it). Measured: the request sent to its
   first audio chunk.

Replies are capped at `--max-output-tokens` text tokens (the VAD session's at `--barge-max-output-tokens`, so
that a reply still speaks when the user cuts in); the Talker speaks until its end or its cap (2 s plus
8 frames a token). On random weights neither end is forced: each row shows the replies' median text tokens
and audio seconds, and how many completed. Every turn's audio carries its own dither (realtime_turns.py).
Each part also records what the server's /metrics counted over it: its own mean end of speech to first audio
delta sent, the means of that time's phases (omnistage_realtime_phase_seconds: the layout, the audio tower,
the queue, the prefill, the speech stages' first chunk, the send), and the prefix and audio-tower caches' hits
(the turns of a session hit; the baseline must not).
Under --out-dir: realtime.json (each part's numbers as it ends) and server.log; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import shlex
import signal
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from omnistage.bench import realtime_turns as rt
from omnistage.bench.clients import first_model, spoken_chat
from omnistage.bench.realtime_socket import Microphone, Reply, Session, speak
from omnistage.bench.server_process import ServerProcess
from omnistage.bench.sse_client import StreamClient
from omnistage.bench.sweep import run

log = logging.getLogger("omnistage.bench")

SPEECH = Path(__file__).parents[2] / "tests" / "data" / "speech_en.wav"
INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}


class Bench:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args, self.url = args, url
        speech, rate = soundfile.read(SPEECH, dtype="float32")
        self.turn_audio = rt.utterance(speech, rate, args.utterance_s)
        self.short_audio = rt.utterance(speech, rate, args.barge_utterance_s)
        self.conversation: tuple[list[bytes], list[str]] | None = None  # one session's turns and replies

    def settings(self, detection: dict[str, Any] | None, max_output_tokens: int) -> dict[str, Any]:
        return {
            "instructions": INSTRUCTIONS,
            "output_modalities": ["audio"],
            "max_output_tokens": max_output_tokens,
            "audio": {"input": {"turn_detection": detection}},
        }

    async def manual_session(self, c: int, index: int, delay: float) -> list[rt.Turn]:
        """One session's turns, commit to first audio each."""
        numbers = range(1, self.args.turns + 1)
        sent_audio = [rt.pcm16(self.turn_audio, seed=c * 100_000 + index * 100 + n) for n in numbers]
        pauses = np.random.default_rng(c * 1000 + index).uniform(0.0, self.args.think_s, len(numbers))
        await asyncio.sleep(delay)
        session = await Session.open(self.url, self.settings(None, self.args.max_output_tokens))
        turns: list[rt.Turn] = []
        replies: list[str] = []
        heard: Reply | None = None  # the last reply
        try:
            for number, pcm, pause in zip(numbers, sent_audio, pauses, strict=True):
                if heard is not None and self.args.listen:
                    await self.listen(heard, pause)
                await speak(session, pcm, 100, self.args.pace)
                await session.send({"type": "input_audio_buffer.commit"})
                committed = time.perf_counter()
                await session.send({"type": "response.create"})
                _, created = await session.until("response.created")
                reply = await session.done(created["response"]["id"])
                if reply.first_audio is None:
                    raise RuntimeError(f"turn {number}: the reply ({reply.status}) had no audio")
                turns.append(
                    rt.Turn(
                        c,
                        number,
                        reply.first_audio - committed,
                        reply.text_tokens,
                        reply.audio_s,
                        reply.status,
                    )
                )
                replies.append(reply.transcript)
                heard = reply
        finally:
            await session.close()
        if self.conversation is None:
            self.conversation = (sent_audio, replies)
        return turns

    async def listen(self, reply: Reply, pause: float) -> None:
        """The user hears `reply` out (its audio played at real time from its first packet), then pauses."""
        assert reply.first_audio is not None
        await asyncio.sleep(max(0.0, reply.first_audio + reply.audio_s - time.perf_counter()) + pause)

    async def manual(self, c: int) -> list[rt.Turn]:
        stagger = self.args.stagger_s / c
        sessions = [self.manual_session(c, i, i * stagger) for i in range(c)]
        return [turn for turns in await asyncio.gather(*sessions) for turn in turns]

    async def vad_and_barge_in(self) -> dict[str, Any]:
        """One session under server VAD: the first turn, then replies cut off by the user speaking again, each
        cut's speech the next turn."""
        session = await Session.open(self.url, self.settings(VAD, self.args.barge_max_output_tokens))
        mic = Microphone(session, 20)
        turns, cuts, uncut = [], [], []
        try:
            mic.say(rt.pcm16(self.turn_audio, seed=7))
            for cut in range(self.args.barge_ins + 1):
                stopped, _ = await session.until("input_audio_buffer.speech_stopped")
                _, created = await session.until("response.created")
                response = created["response"]["id"]
                reply, first = await session.speaking(response)
                turns.append((response, first - stopped))
                if cut == self.args.barge_ins:
                    await session.done(response)
                    break
                await asyncio.sleep(max(0.0, first + self.args.barge_after_s - time.perf_counter()))
                onset, _ = mic.say(rt.pcm16(self.short_audio, seed=70 + cut))
                started, _ = await session.until("input_audio_buffer.speech_started")
                await session.done(response)
                if reply.status != "cancelled":
                    uncut.append(started - first)  # it had ended before the user spoke
                    continue
                cuts.append(rt.Cut(onset, started, reply.last_audio or first, reply.done_at or started))
        finally:
            await mic.stop()
            await session.close()
        replies = [(session.replies[response], latency) for response, latency in turns]
        vad = [
            rt.Turn(1, 1 if i == 0 else 2, latency, r.text_tokens, r.audio_s, r.status)
            for i, (r, latency) in enumerate(replies)
        ]
        return {"turns": vad, "cuts": cuts, "uncut_after_s": uncut}

    async def baseline(self, c: int, model: str) -> list[rt.Turn]:
        """Turn 1 and the last turn as whole chats, c at once each, nothing cached."""
        assert self.conversation is not None
        audio, replies = self.conversation
        client = StreamClient(self.url)
        turns: list[rt.Turn] = []
        try:
            for number in sorted({1, self.args.turns}):
                # every body built before any request's clock starts: building one (the WAVs, base64) while
                # others are in flight would stall the loop that times them
                bodies = [self.chat_body(model, audio, replies, number) for _ in range(c)]
                turns += await asyncio.gather(*(self.chat(client, body, number, c) for body in bodies))
        finally:
            client.close()
        return turns

    def chat_body(self, model: str, audio: list[bytes], replies: list[str], number: int) -> bytes:
        """Turn `number`'s whole conversation as one streamed chat request that no cache can serve."""
        nonce = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"[{nonce}] {INSTRUCTIONS}"}]
        for turn in range(number):
            sent = np.frombuffer(audio[turn], "<i2").astype(np.float32) / 32768
            fresh = rt.pcm16(sent, seed=int(nonce[:8], 16) + turn)
            clip = {"data": base64.b64encode(rt.wav(fresh)).decode(), "format": "wav"}
            messages.append({"role": "user", "content": [{"type": "input_audio", "input_audio": clip}]})
            if turn < number - 1:
                messages.append({"role": "assistant", "content": replies[turn]})
        body = {
            "model": model,
            "messages": messages,
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "pcm16"},
            "max_tokens": self.args.max_output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return json.dumps(body).encode()

    async def chat(self, client: StreamClient, payload: bytes, number: int, c: int) -> rt.Turn:
        """One chat request, from its sending to its first audio chunk."""
        reply = await spoken_chat(client, payload)
        if reply.first_audio is None:
            raise RuntimeError(f"chat turn {number}: no audio")
        text = (reply.usage.get("completion_tokens_details") or {}).get("text_tokens", 0)
        seconds = reply.pcm_bytes / 2 / rt.RATE
        return rt.Turn(c, number, reply.first_audio - reply.start, text, seconds, "completed")


async def bench(args: argparse.Namespace, url: str, record: dict[str, Any]) -> list[str]:
    """Every part in turn, each under its own timeout; the table's rows."""
    b = Bench(args, url)
    model = first_model(url, None)
    show = tuple(sorted({1, args.turns}))
    rows = [rt.HEADER]

    def emit(new: list[str]) -> None:
        """Rows as each part ends, and the record so far: a run cut short keeps what it measured."""
        rows.extend(new)
        print("\n".join(new), flush=True)
        (args.out_dir / "realtime.json").write_text(json.dumps(record, indent=1) + "\n")

    async def part(name: str, seconds: float, work: Any) -> Any:
        start, before = time.perf_counter(), await metrics(url)
        try:
            async with asyncio.timeout(seconds):
                result = await work
        except Exception as exc:  # a part that fails or runs out of time leaves the others their go
            log.exception("%s failed", name)
            record.setdefault("failed", {})[name] = repr(exc)
            return None
        view = rt.server_view(before, await metrics(url))
        record.setdefault("server", {})[name] = view
        log.info("%s: %.1f s", name, time.perf_counter() - start)
        log.info("%s, the server's count: %s", name, view)
        return result

    warm = argparse.Namespace(**{**vars(args), "turns": 1, "pace": 0.0})
    await part("warm-up", args.part_timeout_s, Bench(warm, url).manual_session(0, 0, 0.0))
    for c in args.concurrency:
        turns = await part(f"manual c={c}", args.part_timeout_s, b.manual(c))
        if turns is not None:
            record.setdefault("manual", []).extend(asdict(t) for t in turns)
            emit(rt.latency_rows(turns, "commit → first audio (realtime)", show))
    measured = await part("vad and barge-in", args.part_timeout_s, b.vad_and_barge_in())
    if measured is not None:
        record["vad"] = {
            key: [asdict(v) for v in values] if key != "uncut_after_s" else values
            for key, values in measured.items()
        }
        vad = measured["turns"]
        first = f"speech_stopped → first audio (VAD, {args.utterance_s:g} s turn)"
        again = f"speech_stopped → first audio (VAD, {args.barge_utterance_s:g} s turn after a barge-in)"
        new = rt.latency_rows(vad, first, (1,)) + rt.latency_rows(vad, again, (2,))
        new += rt.barge_in_rows(measured["cuts"])
        if measured["uncut_after_s"]:
            uncut = len(measured["uncut_after_s"])
            new.append(
                f"| barge-in: replies over before the user spoke | 1 | - | {uncut} | - | - | - | - | - | - |"
            )
        emit(new)
    if b.conversation is not None:
        for c in args.concurrency:
            turns = await part(f"baseline c={c}", args.part_timeout_s, b.baseline(c, model))
            if turns is not None:
                record.setdefault("baseline", []).extend(asdict(t) for t in turns)
                emit(rt.latency_rows(turns, "request → first audio (chat, no cache)", show))
    return rows


async def metrics(url: str) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        return rt.scraped((await client.get(f"{url}/metrics")).text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omnistage.bench.realtime", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--url", help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", default="", help="`omnistage serve` flags for the server it starts")
    p.add_argument("--released", action="store_true", help="serve a released-size skeleton (--model)")
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--part-timeout-s", type=float, default=120.0, help="each part's limit")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--utterance-s", type=float, default=10.0)
    p.add_argument(
        "--pace", type=float, default=1.0, help="times real time the turns' audio goes (0: at once)"
    )
    p.add_argument("--stagger-s", type=float, default=3.0, help="the c sessions' starts spread over this")
    p.add_argument("--listen", action=argparse.BooleanOptionalAction, default=True,
                   help="the user hears each reply out before the next turn (--no-listen: at response.done)")  # fmt: skip
    p.add_argument("--think-s", type=float, default=1.0,
                   help="then pauses up to this long (uniform, seeded per session and turn)")  # fmt: skip
    p.add_argument("--max-output-tokens", type=int, default=8)
    p.add_argument("--barge-ins", type=int, default=3)
    p.add_argument("--barge-max-output-tokens", type=int, default=32,
                   help="the VAD session's replies: long enough to be still speaking when the user cuts in")  # fmt: skip
    p.add_argument("--barge-after-s", type=float, default=0.2, help="after the reply's first audio")
    p.add_argument("--barge-utterance-s", type=float, default=2.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # `timeout` ends a run with SIGTERM: exit through the finally below, so the server does not outlive it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    server = None
    if args.url is None:
        serve = shlex.split(args.serve_args)
        if args.released:
            from omnistage.bench.skeletons import released_skeleton

            serve = ["--model", str(released_skeleton()), "--load-format", "dummy", *serve]
        start = time.perf_counter()
        server = ServerProcess(serve, args.out_dir / "server.log").wait_ready(args.start_timeout_s)
        record["server_start_s"] = round(time.perf_counter() - start, 1)
        log.info("server ready in %.1f s", record["server_start_s"])
        args.url = server.url
    try:
        rows = run(bench(args, args.url, record))
    finally:
        if server is not None:
            server.stop()
        (args.out_dir / "realtime.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\nThe table:\n" + "\n".join(rows))
    return 1 if record.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
