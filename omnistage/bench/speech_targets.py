"""What one spoken request is, and how it reaches each target of `omnistage bench t2s|s2s`.

In-process, through an AsyncPipeline over the pipeline; over HTTP, through a running server's streamed
OpenAI-shaped API. Each target turns a SpeechInput into its SpeechTiming: the first audio packet, the end,
and the audio and frames produced (see `speech.py` for what is measured and why).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from omnistage.bench.clients import JSON_HEADERS, events, spoken_chat
from omnistage.bench.clips import Clip, synth_clips
from omnistage.outputs import AUDIO_SAMPLE_RATE

if TYPE_CHECKING:
    import httpx

    from omnistage.request import GenerationRequest, SamplingParams

log = logging.getLogger("omnistage.bench")

FRAMES_PER_SECOND = 12.5  # codec frames per second of audio
S2S_CLIP_SECONDS = 5.0
NUM_INPUTS = 4  # distinct prompts (or clips) a pass cycles through

_PROMPTS = (
    "Tell me about the history of the bicycle in a few sentences.",
    "What should I pack for a weekend of hiking in the mountains?",
    "Explain why the sky is blue to a ten year old.",
    "Describe your favourite season and what you like to do in it.",
)


@dataclass(frozen=True)
class SpeechInput:
    """One request's input: a text turn (t2s, or the text to speak with --tts), or a clip (s2s)."""

    name: str
    text: str
    clip: Clip | None = None

    def as_request(self, number: int, run: int = 0) -> SpeechInput:
        """This input as request `number` of benchmark run `run` sends it, distinct from every other request's:
        a clip with their dither (`Clip.heard_as`), a text opening with the numbers, the request's first (the
        run's first would give a run's requests a first page in common). A real stream of turns repeats neither;
        a pass cycling NUM_INPUTS inputs would otherwise find its prompts in the prefix cache and its clips in
        the audio tower's."""
        if self.clip is not None:
            return replace(self, clip=self.clip.heard_as(number, run))
        label = f"{number} of run {run}" if run else f"{number}"
        return replace(self, text=f"Request {label}. {self.text}")

    def messages(self) -> list[dict[str, Any]]:
        """The chat as the processor takes it in-process (decoded audio)."""
        if self.clip is None:
            return [{"role": "user", "content": self.text}]
        return [{"role": "user", "content": [{"type": "audio", "audio": self.clip.audio}]}]

    def http_messages(self) -> list[dict[str, Any]]:
        """The chat as an OpenAI client sends it (audio as base64 WAV)."""
        if self.clip is None:
            return self.messages()
        audio = {"data": base64.b64encode(self.clip.wav_bytes()).decode(), "format": "wav"}
        return [{"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]}]


def speech_inputs(workload: str, seed: int = 0, espeak: bool | None = None) -> list[SpeechInput]:
    if workload == "s2s":
        clips = synth_clips([S2S_CLIP_SECONDS] * NUM_INPUTS, seed=seed, espeak=espeak)
        return [SpeechInput(c.name, c.transcript or "", c) for c in clips]
    return [SpeechInput(f"prompt-{i}", text) for i, text in enumerate(_PROMPTS[:NUM_INPUTS])]


@dataclass(frozen=True)
class SpeechTiming:
    """One spoken request, timed from its arrival (seconds)."""

    first_packet_s: float  # to the first decodable audio
    latency_s: float  # to its end
    audio_s: float  # audio produced
    frames: int  # codec frames
    text_tokens: int
    stages: dict[str, float] = field(default_factory=dict)  # seconds from arrival, where the target tells

    @property
    def rtf(self) -> float:
        """Wall seconds per second of audio; lower is better (inf for a request that made no audio)."""
        return self.latency_s / self.audio_s if self.audio_s > 0 else math.inf


Runner = Callable[[SpeechInput, int], Awaitable[SpeechTiming]]  # (input, request number) -> its timing


def text_fields(text_tokens: int, forced: bool) -> dict[str, Any]:
    """The Thinker's sampling: greedy, exactly `text_tokens` tokens when forced, else at most."""
    if forced:
        return {"max_tokens": text_tokens, "min_tokens": text_tokens, "ignore_eos": True, "temperature": 0.0}
    return {"max_tokens": text_tokens, "temperature": 0.0}


def talker_params(frames: int, forced: bool) -> SamplingParams:
    """The Talker's sampling: the released defaults, exactly `frames` frames when forced, else at most."""
    from omnistage.request import talker_sampling_defaults

    if forced:
        return replace(talker_sampling_defaults(), max_tokens=frames, min_tokens=frames, ignore_eos=True)
    return replace(talker_sampling_defaults(), max_tokens=frames)


def inprocess_runner(
    engine: Any, tts: bool, text_tokens: int, frames: int, voice: str, forced: bool
) -> Runner:
    """Requests straight into an AsyncPipeline, prompts laid out by its Frontend as the server does."""
    from omnistage.request import GenerationRequest, SamplingParams, SpeechParams

    frontend = engine.frontend
    speech = SpeechParams(voice=voice, talker=talker_params(frames, forced))
    chat_params = SamplingParams(**text_fields(text_tokens, forced))

    async def run(item: SpeechInput, number: int) -> SpeechTiming:
        item = item.as_request(number)
        start = time.monotonic()
        mrope = mm = None
        if tts:
            prompt = frontend.tts_prompt(item.text)
            text, ids = prompt.prompt, prompt.token_ids
            # the Thinker does not run: its sampling is never read, one token satisfies its checks
            params, spoken = (
                SamplingParams(max_tokens=1),
                replace(speech, reply_token_ids=prompt.reply_token_ids),
            )
        else:
            prompt = await asyncio.to_thread(frontend.processor.process_chat, item.messages())
            text, ids, mrope, mm = prompt.prompt, prompt.token_ids, prompt.mrope, prompt.mm
            params, spoken = chat_params, speech
        stages = {"preprocess": time.monotonic() - start}
        request = GenerationRequest(f"speech-{number}", ids, params, text, mrope, mm, spoken)
        return await spoken_timing(engine, request, item.name, frames if forced else None, start, stages)

    return run


async def spoken_timing(
    engine: Any,
    request: GenerationRequest,
    name: str,
    forced_frames: int | None,
    start: float,
    stages: dict[str, float],
    marks: tuple[str, ...] = (),
) -> SpeechTiming:
    """Run `request` through the AsyncPipeline `engine` and time it from `start` (time.monotonic), `stages`
    (seconds from `start`) gaining the Thinker's first token where it ran and the engine's `marks` (its
    RequestOutput.metrics, e.g. "encoded") where it set them; a failed request, or one that did not speak its
    `forced_frames`, raises RuntimeError naming `name`."""
    first, samples, final = None, 0, None
    async for out in engine.generate(request):
        if out.audio_delta is not None and len(out.audio_delta):
            first = first or time.monotonic()
            samples += len(out.audio_delta)
        final = out
    end = time.monotonic()
    if final is None or final.outputs[0].finish_reason in ("error", "abort"):
        raise RuntimeError(f"{name}: the engine failed it: {final and final.error}")
    if forced_frames is not None and final.num_audio_frames != forced_frames:
        raise RuntimeError(f"{name}: {final.num_audio_frames} frames, not the {forced_frames} forced")
    stages |= {mark: final.metrics[mark] - start for mark in marks if mark in final.metrics}
    if "first_token" in final.metrics:  # the Thinker's first token (a --tts request has none)
        stages["first_text_token"] = final.metrics["first_token"] - start
    return SpeechTiming(
        (first or end) - start,
        end - start,
        samples / AUDIO_SAMPLE_RATE,
        final.num_audio_frames,
        len(final.outputs[0].token_ids),
        stages,
    )


def frame_fields(frames: int, forced: bool) -> dict[str, Any]:
    """The server's Talker fields for `frames` frames: exactly that many when forced, else at most."""
    return (
        {"max_frames": frames, "min_frames": frames, "ignore_eos": True} if forced else {"max_frames": frames}
    )


def server_runner(
    client: httpx.AsyncClient, model: str, tts: bool, text_tokens: int, frames: int, voice: str, forced: bool
) -> Runner:
    """Streamed requests to a running server through `client` (based at its URL), audio as raw pcm16; forced
    lengths go as the server's `min_frames` and `ignore_eos` beside `max_frames`."""

    run = random.randrange(1, 2**31)  # the server outlives this run: its requests are not an earlier run's

    def timing(
        item: SpeechInput, start: float, first: float | None, pcm_bytes: int, usage: dict
    ) -> SpeechTiming:
        end = time.perf_counter()
        if tts:  # /v1/audio/speech counts the frames as its output tokens
            got_frames, got_text = usage.get("output_tokens", 0), 0
        else:
            details = usage.get("completion_tokens_details") or {}
            got_frames, got_text = details.get("audio_tokens", 0), details.get("text_tokens", 0)
        if forced and got_frames != frames:
            log.warning("%s: %d frames, not the %d asked for", item.name, got_frames, frames)
        seconds = pcm_bytes / 2 / AUDIO_SAMPLE_RATE
        return SpeechTiming((first or end) - start, end - start, seconds, got_frames, got_text)

    async def chat(item: SpeechInput, number: int) -> SpeechTiming:
        item = item.as_request(number, run)
        body = {
            "model": model,
            "messages": item.http_messages(),
            "modalities": ["text", "audio"],
            "audio": {"voice": voice, "format": "pcm16", **frame_fields(frames, forced)},
            "stream": True,
            "stream_options": {"include_usage": True},
            **text_fields(text_tokens, forced),
        }
        reply = await spoken_chat(client, json.dumps(body).encode())
        return timing(item, reply.start, reply.first_audio, reply.pcm_bytes, reply.usage)

    async def speak(item: SpeechInput, number: int) -> SpeechTiming:
        item = item.as_request(number, run)
        body = {
            "model": model,
            "input": item.text,
            "voice": voice,
            "response_format": "pcm",
            "stream_format": "sse",
            **frame_fields(frames, forced),
        }
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        first, pcm_bytes = None, 0
        usage: dict[str, Any] = {}
        async for event in events(client, "/v1/audio/speech", payload, JSON_HEADERS, {}):
            if event.get("type") == "speech.audio.delta" and event.get("audio"):
                first = first or time.perf_counter()
                pcm_bytes += len(base64.b64decode(event["audio"]))
            elif event.get("type") == "speech.audio.done":
                usage = event.get("usage") or {}
        return timing(item, start, first, pcm_bytes, usage)

    return speak if tts else chat
