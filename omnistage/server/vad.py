"""Server voice-activity detection for realtime sessions: where a user's turn starts and stops in the audio
they stream, as OpenAI's `turn_detection: server_vad` reports it.

Silero VAD (its ONNX model, shipped in the `silero-vad` wheel, run by onnxruntime) gives a speech probability
for every 32 ms frame at 16 kHz; other input rates are resampled to 16 kHz by a streaming soxr resampler,
whose output does not depend on how the input is split. A `TurnTracker` turns the probabilities into events:
a turn starts on the first frame at or above `threshold` and stops once frames below `threshold - 0.15` have
lasted `silence_duration_ms` (silero's own hysteresis, so a probability wobbling around the threshold does
not end a turn). Frames lie on a fixed grid from the start of the stream, so the same audio gives the same
events however it is chunked. benchmarks/RESULTS.md ("Server VAD on the CPU") has the accuracy and cost
beside webrtcvad's.

Cost: one onnxruntime call per frame, ~0.18 ms on one core (~6-7 ms per second of audio, 31 frames; RESULTS.md's row); the
model's state is 1 KB per session and the ONNX session is shared by all of them. onnxruntime lets go of the
GIL while it runs, so `feed_in_thread` keeps the event loop free: it runs `feed` on one thread shared by
every session, in the order the calls were made.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime
import soxr

MODEL_RATE = 16000  # silero's rate (it also takes 8 kHz; one rate keeps one frame grid)
FRAME_SAMPLES = 512  # silero's frame at 16 kHz: 32 ms
FRAME_MS = FRAME_SAMPLES * 1000 // MODEL_RATE
_CONTEXT_SAMPLES = 64  # the tail of the previous frame silero sees before each frame
_HYSTERESIS = 0.15  # below threshold - this, a frame counts as silence (silero's streaming default)

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vad")


@dataclass(frozen=True)
class VadSettings:
    """OpenAI's `turn_detection` fields for `server_vad`."""

    threshold: float = 0.5  # 0..1, speech probability
    prefix_padding_ms: int = 300  # audio kept before the detected start
    silence_duration_ms: int = 500  # silence that ends a turn


@dataclass(frozen=True)
class VadEvent:
    """A turn's edge. `audio_ms` is a position in the session's input stream (ms since it began), as OpenAI's
    `audio_start_ms` (the detected start less the prefix padding, not before the last reset) and
    `audio_end_ms` (the end of the silence that stopped the turn: where the silence began plus
    `silence_duration_ms`, rounded up to a frame)."""

    kind: Literal["speech_started", "speech_stopped"]
    audio_ms: int


class TurnTracker:
    """Speech probabilities, one per frame, in; turn edges out. Pure bookkeeping, no audio."""

    def __init__(self, settings: VadSettings, frame_ms: int) -> None:
        self.settings = settings
        self.frame_ms = frame_ms
        self.silence_below = max(settings.threshold - _HYSTERESIS, 0.01)
        self.frames = 0  # frames seen since the stream began
        self.reset(buffer_start_ms=0)

    def reset(self, buffer_start_ms: int) -> None:
        """Forget the turn under way; a prefix never reaches back before `buffer_start_ms`."""
        self.buffer_start_ms = buffer_start_ms
        self.speaking = False
        self.silent_since_ms: int | None = None

    def step(self, probability: float) -> VadEvent | None:
        start_ms = self.frames * self.frame_ms
        self.frames += 1
        end_ms = start_ms + self.frame_ms
        if not self.speaking:
            if probability < self.settings.threshold:
                return None
            self.speaking = True
            padded = max(start_ms - self.settings.prefix_padding_ms, self.buffer_start_ms)
            return VadEvent("speech_started", padded)
        if probability >= self.settings.threshold:
            self.silent_since_ms = None
        elif probability < self.silence_below and self.silent_since_ms is None:
            self.silent_since_ms = start_ms
        if (
            self.silent_since_ms is not None
            and end_ms - self.silent_since_ms >= self.settings.silence_duration_ms
        ):
            self.speaking = False
            self.silent_since_ms = None
            return VadEvent("speech_stopped", end_ms)
        return None


@functools.cache
def _silero_session() -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    # One frame is a few small matmuls: more threads only add wake-ups, and sessions run side by side anyway.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    # Found, not imported: importing silero_vad sets torch's threads to one for the whole process.
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("server VAD needs the silero-vad package")
    model = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.onnx"
    return onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


class SileroFrames:
    """Silero VAD's recurrent state for one stream: a 16 kHz frame in, its speech probability out."""

    def __init__(self) -> None:
        self.session = _silero_session()
        self.rate = np.array(MODEL_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self.state = np.zeros((2, 1, 128), dtype=np.float32)
        self.window = np.zeros((1, _CONTEXT_SAMPLES + FRAME_SAMPLES), dtype=np.float32)

    def probability(self, frame: np.ndarray) -> float:
        self.window[0, :_CONTEXT_SAMPLES] = self.window[0, -_CONTEXT_SAMPLES:]
        self.window[0, _CONTEXT_SAMPLES:] = frame
        output, self.state = self.session.run(
            None, {"input": self.window, "state": self.state, "sr": self.rate}
        )
        return float(output[0, 0])


class SpeechDetector:
    """One session's input stream in, the turns' starts and stops out.

    Events come out as soon as their frame is complete: a start one frame (32 ms) after the speech reaches the
    threshold at most, plus the resampler's few milliseconds at rates other than 16 kHz."""

    def __init__(self, settings: VadSettings, sample_rate: int = 16000) -> None:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.settings = settings
        self.sample_rate = sample_rate
        self.resampler = (
            None
            if sample_rate == MODEL_RATE
            else soxr.ResampleStream(sample_rate, MODEL_RATE, 1, dtype="float32")
        )
        self.frames = SileroFrames()
        self.tracker = TurnTracker(settings, FRAME_MS)
        self.pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples short of a whole frame
        self.samples_in = 0  # input samples fed since the stream began

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        """Mono float32 samples at `sample_rate`, any length; the events their frames completed."""
        if pcm.ndim != 1:
            raise ValueError(f"pcm must be mono (one dimension), got shape {pcm.shape}")
        if pcm.dtype.kind != "f":  # int16 taken as floats would be 32768 times too loud
            raise ValueError(f"pcm must be float samples in -1..1, got {pcm.dtype}")
        samples = pcm.astype(np.float32, copy=False)
        self.samples_in += len(samples)
        if self.resampler is not None:
            samples = self.resampler.resample_chunk(samples)
        audio = np.concatenate((self.pending, samples)) if len(self.pending) else samples
        whole = len(audio) - len(audio) % FRAME_SAMPLES
        events = []
        for start in range(0, whole, FRAME_SAMPLES):
            event = self.tracker.step(self.frames.probability(audio[start : start + FRAME_SAMPLES]))
            if event is not None:
                events.append(event)
        self.pending = audio[whole:].copy()
        return events

    async def feed_in_thread(self, pcm: np.ndarray) -> list[VadEvent]:
        """`feed` off the event loop, on the thread all sessions share (calls run in the order made)."""
        return await asyncio.get_running_loop().run_in_executor(_executor, self.feed, pcm)

    def reset(self) -> None:
        """A new buffer (after a clear or a commit): the turn under way and the model's memory are dropped; the
        stream's position keeps counting, and the next start's prefix stays within the new buffer."""
        self.frames.reset()
        self.tracker.reset(buffer_start_ms=self.samples_in * 1000 // self.sample_rate)
