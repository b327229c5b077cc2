"""What one video-to-speech request of `omnistage bench v2s` is, and how it runs in-process.

Each length's videos are written once (`write_videos`: `videos.sliding` frames at a low source rate, a tone for
its sound track), one file per request the run sends, each with frames and a tone of its own, into a directory
that a MediaPolicy admits as its `media_dir`: no request's video is another's, so the prefix cache and the
audio tower's cache serve none of it (one file for all would make every timed request's prefill a cache hit).
Every request then takes the server's path from its file: a `video_url` part naming the file, fetched and
decoded by `omnistage.media` (frames sampled at the processor's rules, the sound track at 16 kHz,
`use_audio_in_video`), laid out by the processor, and run through an AsyncPipeline. All of it is inside the
request's time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omnistage.bench.speech_targets import SpeechTiming, spoken_timing, talker_params, text_fields
from omnistage.bench.videos import encode, sliding
from omnistage.media import MediaPolicy, VideoOptions, decode_messages

QUESTION = "What happens in this video, and what do you hear?"
ANSWER = (
    "A bright field drifts slowly to one side while a steady tone plays."  # the first turn's, as sent back
)
FOLLOW_UP = "Which way does it drift, and does the tone change?"
# The sound track ends this much before the picture: an AAC encoder's priming and padding samples decode as
# part of the track, so an exactly 120 s track reads as 120.03 s and exceeds VideoLimits.max_seconds.
TRACK_MARGIN_S = 0.1


@dataclass(frozen=True)
class VideoInput:
    """One length's video file, the other requests' files of that length (`copies`), and the rate frames are
    sampled at (None: the processor's)."""

    name: str
    seconds: float
    path: Path
    fps: float | None = None
    copies: tuple[Path, ...] = ()

    def as_request(self, number: int) -> VideoInput:
        """The input request `number` sends (the warm-up's numbers are negative): its own file of the length,
        while the run sends no more requests than there are files."""
        files = (self.path, *self.copies)
        return replace(self, path=files[number % len(files)])

    def messages(self, follow_up: bool = False) -> list[dict[str, Any]]:
        """The chat as a client sends it: the video as a `video_url` naming the file, then the question; with
        `follow_up`, the conversation's second turn: that turn, its answer, then the next question."""
        video = {"type": "video_url", "video_url": {"url": str(self.path)}}
        first = [{"role": "user", "content": [video, {"type": "text", "text": QUESTION}]}]
        if not follow_up:
            return first
        return [*first, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}]

    def options(self) -> VideoOptions:
        return VideoOptions(use_audio_in_video=True, fps=self.fps)


def write_videos(
    seconds: list[float],
    resolution: tuple[int, int],
    directory: Path,
    source_fps: int,
    seed: int = 0,
    files: int = 1,
) -> list[VideoInput]:
    """`files` mp4s (H.264, AAC tone) per length under `directory`, each picture moving at `source_fps` frames a
    second (the processor samples 2 a second, so a low source rate decodes as it will be sampled) from a
    field and with a tone of its own."""
    width, height = resolution
    directory.mkdir(parents=True, exist_ok=True)
    inputs = []
    for i, length in enumerate(seconds):
        count = max(round(length * source_fps), 2)
        paths = []
        for k in range(files):
            data = encode(
                sliding(count, width, height, seed + i + 7919 * k),
                fps=source_fps,
                tone_hz=220.0 + 110 * i + 3 * k,
                tone_seconds=max(count / source_fps - TRACK_MARGIN_S, 0.1),
            )
            paths.append(directory / f"video-{length:g}s-{width}x{height}-{k}.mp4")
            paths[-1].write_bytes(data)
        inputs.append(VideoInput(f"video-{length:g}s", length, paths[0], copies=tuple(paths[1:])))
    return inputs


def fitting_fps(
    item: VideoInput, processor: Any, policy: MediaPolicy, context: int, new_tokens: int, rates: list[float]
) -> tuple[VideoInput, int]:
    """`item` at the first of `rates` whose prompt leaves `new_tokens` within the context, and its prompt
    tokens; the last rate's when none does (the run then reports the engine's refusal)."""
    tokens = 0
    for fps in rates:
        candidate = replace(item, fps=fps)
        decoded = decode_messages(candidate.messages(), policy, candidate.options())
        tokens = len(processor.process_chat(decoded, True, None, True).token_ids)
        if tokens + new_tokens <= context:
            return candidate, tokens
    return candidate, tokens


def sample_rates(processor_fps: float, temporal_patch_size: int, given: float | None) -> list[float]:
    """The rates `fitting_fps` tries: `given` alone, else the processor's and its halves down to a quarter
    (each a temporal patch of whole seconds, as video_processing.check_fps requires)."""
    if given is not None:
        return [given]
    first = max(round(temporal_patch_size / processor_fps), 1)
    return [temporal_patch_size / k for k in (first, 2 * first, 4 * first)]


def inprocess_runner(
    engine: Any,
    policy: MediaPolicy,
    text_tokens: int,
    frames: int,
    voice: str,
    forced: bool,
    follow_up: bool = False,
    first_turns: list[SpeechTiming] | None = None,
) -> Callable[[VideoInput, int], Awaitable[SpeechTiming]]:
    """Requests into an AsyncPipeline as the server makes them; stages from arrival: `decode` (the file read
    and decoded), `preprocess` (laid out by the processor), `encoded` (through the towers), the first text
    token. With `follow_up` each request is a conversation's second turn about its video, timed, its first
    turn run just before it and not timed: what a chat's next question costs where the server kept what the
    turns share (`policy`'s decoded videos, the encoder cache, both prefix caches); the timed requests' first
    turns (each a video new to the server) are appended to `first_turns`."""
    from omnistage.request import GenerationRequest, SamplingParams, SpeechParams

    frontend = engine.frontend
    speech = SpeechParams(voice=voice, talker=talker_params(frames, forced))
    params = SamplingParams(**text_fields(text_tokens, forced))

    async def run(given: VideoInput, number: int, second: bool = follow_up) -> SpeechTiming:
        if second:
            first = await run(given, number, second=False)
            if first_turns is not None and number >= 0:
                first_turns.append(first)
        item = given.as_request(number)
        start = time.monotonic()
        decoded = await asyncio.to_thread(decode_messages, item.messages(second), policy, item.options())
        stages = {"decode": time.monotonic() - start}
        prompt = await asyncio.to_thread(
            frontend.processor.process_chat, decoded, True, frontend.max_model_len, True
        )
        stages["preprocess"] = time.monotonic() - start
        request = GenerationRequest(
            f"video-{number}-{1 + second}",
            prompt.token_ids,
            params,
            prompt.prompt,
            prompt.mrope,
            prompt.mm,
            speech,
        )
        forced_frames = frames if forced else None
        return await spoken_timing(engine, request, item.name, forced_frames, start, stages, ("encoded",))

    return run
