"""What `omnistage bench a2t` times: a running server's streamed chat or transcription requests, or an
AsyncPipeline in this process, each as a Runner of one clip's request. Each request sends its clip as its own
(`Clip.heard_as` its number, before its clock starts): the caches serve it nothing a fresh recording would not
get."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from omnistage.bench.clients import JSON_HEADERS, events
from omnistage.bench.clips import Clip
from omnistage.bench.sse_client import StreamClient
from omnistage.bench.stats import RequestTiming

if TYPE_CHECKING:
    import httpx

Runner = Callable[[Clip, int], Awaitable[RequestTiming]]  # (clip, request number) -> its timing


def forced(output_tokens: int | None, max_tokens: int) -> dict[str, Any]:
    """Sampling fields of a request: greedy, and exactly `output_tokens` when given."""
    if output_tokens:
        return {
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
    return {"max_tokens": max_tokens, "temperature": 0.0}


def server_runner(
    client: StreamClient | httpx.AsyncClient,
    model: str,
    endpoint: str,
    output_tokens: int | None,
    max_tokens: int,
) -> Runner:
    """Streamed requests to a running server through `client` (based at its URL); TTFT is the first chunk
    of a chat stream (the server sends it once the first token exists), the first delta of a transcription.

    A request's body is built before its clock starts (the clip's base64 and JSON, or the multipart form): the
    in-process runner builds none either. Its stages split the TTFT as the client saw it: upload (the clock's
    start to the request written), response (to the response's headers in), first_event (to the event that
    counts as the first token)."""
    import httpx

    from omnistage.models.qwen3_omni.transcription import INSTRUCTION

    fields = forced(output_tokens, max_tokens)
    run = random.randrange(1, 2**31)  # the server outlives this run: its requests are not an earlier run's

    async def timed(
        clip: Clip, path: str, body: bytes, headers: dict[str, str], first_token: str
    ) -> RequestTiming:
        stamps: dict[str, float] = {}
        start = time.perf_counter()
        first, tokens, deltas = None, 0, 0
        async for event in events(client, path, body, headers, stamps):
            if first_token in ("", event.get("type")):
                first = first or time.perf_counter()
                deltas += 1
            usage = event.get("usage") or {}
            tokens = usage.get("completion_tokens") or usage.get("output_tokens") or tokens
        end = stamps.get("done") or time.perf_counter()
        sent, headers_in = stamps.get("sent"), stamps.get("headers")
        stages = {}
        if sent is not None and headers_in is not None and first is not None:
            stages = {
                "upload": sent - start,
                "response": headers_in - sent,
                "first_event": first - headers_in,
            }
        return RequestTiming(clip.seconds, (first or end) - start, end - start, tokens or deltas, stages)

    async def chat(clip: Clip, number: int) -> RequestTiming:
        clip = clip.heard_as(number, run)
        audio = {"data": base64.b64encode(clip.wav_bytes()).decode(), "format": "wav"}
        content = [{"type": "input_audio", "input_audio": audio}, {"type": "text", "text": INSTRUCTION}]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "stream_options": {"include_usage": True},
            **fields,
        }
        return await timed(
            clip, "/v1/chat/completions", json.dumps(body).encode(), JSON_HEADERS, first_token=""
        )

    async def transcribe(clip: Clip, number: int) -> RequestTiming:
        clip = clip.heard_as(number, run)
        form = {"model": model, "stream": "true", **{k: _form_value(v) for k, v in fields.items()}}
        files = {"file": (f"{clip.name}.wav", clip.wav_bytes(), "audio/wav")}
        request = httpx.Request("POST", "http://server/", data=form, files=files)
        headers = {"content-type": request.headers["content-type"]}
        return await timed(clip, "/v1/audio/transcriptions", request.read(), headers, "transcript.text.delta")

    return chat if endpoint == "chat" else transcribe


def _form_value(value: float | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def inprocess_runner(
    engine: Any, output_tokens: int | None, max_tokens: int, count_preparing: bool = False
) -> Runner:
    """Requests straight into an AsyncPipeline, prompts laid out by its processor as the server does. With
    `count_preparing`, each request is counted as being prepared from its clock's start until it goes in, as the
    server counts those it reads (`AsyncPipeline.preparing`): an idle engine then holds a burst for its last."""
    from omnistage.request import GenerationRequest, SamplingParams

    params = SamplingParams(**forced(output_tokens, max_tokens))
    processor = engine.frontend.processor

    async def run(clip: Clip, number: int) -> RequestTiming:
        clip = clip.heard_as(number)
        start = time.perf_counter()
        preparing = engine.preparing() if count_preparing else None
        try:
            prompt = await asyncio.to_thread(processor.transcription, clip.audio, None, None)
        except BaseException:
            if preparing is not None:
                preparing.done()
            raise
        prepared = time.perf_counter() - start
        submitted = time.monotonic()
        final, received = None, None
        request = GenerationRequest(
            f"a2t-{number}", prompt.token_ids, params, prompt.prompt, prompt.mrope, prompt.mm
        )
        async for output in engine.generate(request, preparing):
            # the first token as this consumer gets it, as a client over HTTP gets its first chunk
            received = received or (time.monotonic() if output.outputs[0].token_ids else None)
            final = output
        if final is None or final.outputs[0].finish_reason in ("error", "abort"):
            raise RuntimeError(f"{clip.name}: the engine failed it: {final and final.error}")
        m = final.metrics
        received = received or m["first_token"]
        stages = {
            "preprocess": prepared,
            "to_engine": m["arrival"] - submitted,
            "encode": m["encoded"] - m["arrival"],
            "queue": m["scheduled"] - m["encoded"],
            "prefill": m["first_token"] - m["scheduled"],
            "delivery": received - m["first_token"],  # the engine's thread to this consumer
        }
        return RequestTiming(
            clip.seconds,
            received - submitted + prepared,
            m["finished"] - submitted + prepared,
            len(final.outputs[0].token_ids),
            stages,
        )

    return run
