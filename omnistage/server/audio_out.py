"""Spoken audio as a client asked for it: float PCM at 24 kHz mono, time-stretched by `speed`, encoded piece by
piece as the frames are decoded.

pcm is raw 16-bit little-endian samples. mp3, opus (in Ogg) and aac (in ADTS) are FFmpeg's encoders through
PyAV, muxed into a sink that is drained after every piece, so a stream's first bytes leave with its first
frames. wav and flac are written whole by libsndfile (through soundfile): a wav header holds the length, and
a FLAC streamed to a pipe could not go back to write its length and checksum into its STREAMINFO, so players
would show no duration. The lossless formats hold the pcm answer's 16-bit samples exactly.

`speed` other than 1 runs the audio through FFmpeg's `atempo` filter (pitch kept), streamed as well: it
holds back about one piece of audio to fill its window.
"""

from __future__ import annotations

import asyncio
import io
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import cast

import av
import numpy as np
import soundfile

from omnistage.outputs import AUDIO_SAMPLE_RATE

# One atempo instance takes 0.5 to 100; slower is two in a chain.
_ATEMPO_MIN = 0.5


@dataclass(frozen=True)
class Codec:
    """An FFmpeg muxer and encoder, and what they are given."""

    muxer: str
    encoder: str
    bit_rate: int
    muxer_options: dict[str, str] = field(default_factory=dict)


# Bit rates for speech at 24 kHz mono: FFmpeg's libmp3lame default there is ~32 kb/s, audibly poor.
# Ogg holds its packets until a page spans `page_duration` (1 s by default): one page per 20 ms Opus packet
# sends each as it is encoded, at 28 bytes a page.
CODECS = {
    "mp3": Codec("mp3", "libmp3lame", 64_000),
    "opus": Codec("ogg", "libopus", 32_000, {"page_duration": "20000"}),
    "aac": Codec("adts", "aac", 64_000),
}
_FILES = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16")}
# Chat's `audio.format` says pcm16 where /v1/audio/speech says pcm; both are the same raw samples.
_RAW = ("pcm", "pcm16")
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "pcm16": "audio/pcm",
}


def _available(name: str) -> bool:
    """Whether this FFmpeg (PyAV's, or the system's for a source build) has the format's encoder."""
    codec = CODECS.get(name)
    return codec is None or codec.encoder in av.codecs_available


FORMATS = tuple(name for name in CONTENT_TYPES if _available(name))


def progressive(name: str) -> bool:
    """Whether format `name` goes out as the frames are decoded (wav and flac go out whole)."""
    return name not in _FILES


def quantized(pcm: np.ndarray) -> np.ndarray:
    """16-bit samples, rounded once here so that every lossless answer holds the same ones (libsndfile rounds
    floats differently per format); beyond [-1, 1] is clipped."""
    return np.clip(np.rint(pcm * 32768.0), -32768, 32767).astype(np.int16)


def pcm_bytes(pcm: np.ndarray) -> bytes:
    return quantized(pcm).astype("<i2").tobytes()


def _file(pcm: np.ndarray, name: str) -> bytes:
    major, subtype = _FILES[name]
    buffer = io.BytesIO()
    soundfile.write(buffer, quantized(pcm), AUDIO_SAMPLE_RATE, subtype=subtype, format=major)
    return buffer.getvalue()


def _frame(pcm: np.ndarray, pts: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.float32)[None, :], "flt", "mono")
    frame.sample_rate, frame.pts = AUDIO_SAMPLE_RATE, pts
    return frame


class Stretch:
    """FFmpeg's atempo over a stream of pieces: `speed` 2 plays twice as fast at the same pitch."""

    def __init__(self, speed: float) -> None:
        self.graph = av.filter.Graph()
        source = self.graph.add_abuffer(
            format="flt",
            sample_rate=AUDIO_SAMPLE_RATE,
            layout="mono",
            time_base=Fraction(1, AUDIO_SAMPLE_RATE),
        )
        factors = [speed] if speed >= _ATEMPO_MIN else [math.sqrt(speed)] * 2
        tempos = [self.graph.add("atempo", repr(factor)) for factor in factors]
        self.graph.link_nodes(source, *tempos, self.graph.add("abuffersink")).configure()
        self.pts = 0

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        self.graph.push(_frame(pcm, self.pts))
        self.pts += len(pcm)
        return self._ready()

    def flush(self) -> np.ndarray:
        self.graph.push(None)
        return self._ready()

    def _ready(self) -> np.ndarray:
        pieces: list[np.ndarray] = [np.zeros(0, np.float32)]
        while True:
            try:
                frame = self.graph.pull()
            except (av.BlockingIOError, av.EOFError):
                return np.concatenate(pieces)
            pieces.append(frame.to_ndarray().reshape(-1))


class _Sink:
    """Where the muxer writes: the bytes it wrote since the last drain. No seek, so the muxers stream (an
    mp3 has no Xing header, which a muxer goes back to fill in)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


class Encoder:
    """One FFmpeg encoder and muxer writing into a _Sink; every call returns the bytes it made ready."""

    def __init__(self, codec: Codec) -> None:
        self.sink = _Sink()
        # flush_packets: the muxer hands each packet to the sink at once rather than filling its buffer first
        options = codec.muxer_options | {"flush_packets": "1"}
        self.container = av.open(self.sink, "w", format=codec.muxer, options=options)
        self.stream = cast(
            av.AudioStream, self.container.add_stream(codec.encoder, rate=AUDIO_SAMPLE_RATE, layout="mono")
        )
        self.stream.bit_rate = codec.bit_rate
        self.pts = 0

    def __call__(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            self.container.mux(self.stream.encode(_frame(np.clip(pcm, -1.0, 1.0), self.pts)))
            self.pts += len(pcm)
        return self.sink.drain()

    def finish(self) -> bytes:
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return self.sink.drain()

    def close(self) -> None:
        self.container.close()


class AudioOut:
    """One answer's audio in format `name` at `speed`: `write` each piece as it is decoded, then `finish`, each
    returning the bytes ready to send (a whole-file format returns them all at `finish`).

    The work runs in worker threads (`encoded`, `finished`), one call at a time; `close` frees the encoder
    however the answer ended and never waits: a call still running in its thread frees it when it returns.
    """

    def __init__(self, name: str, speed: float = 1.0) -> None:
        self.name = name
        self.stretch = Stretch(speed) if speed != 1.0 else None
        self._encoder: Encoder | None = None
        self._held: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._busy = self._closed = False

    @property
    def _cheap(self) -> bool:
        """pcm at speed 1 is a rounding, quicker than a hop to a thread."""
        return self.stretch is None and self.name in _RAW

    async def encoded(self, pcm: np.ndarray) -> bytes:
        return self.write(pcm) if self._cheap else await asyncio.to_thread(self.write, pcm)

    async def finished(self) -> bytes:
        return self.finish() if self._cheap else await asyncio.to_thread(self.finish)

    def write(self, pcm: np.ndarray) -> bytes:
        return self._run(lambda: self._encode(self.stretch(pcm) if self.stretch else pcm))

    def finish(self) -> bytes:
        return self._run(self._finish)

    def close(self) -> None:
        with self._lock:
            self._closed, busy = True, self._busy
        if not busy:
            self._free()

    def _encode(self, pcm: np.ndarray) -> bytes:
        if self.name in _RAW:
            return pcm_bytes(pcm)
        if self.name in _FILES:
            self._held.append(pcm)
            return b""
        if self._encoder is None:
            self._encoder = Encoder(CODECS[self.name])
        return self._encoder(pcm)

    def _finish(self) -> bytes:
        tail = self._encode(self.stretch.flush()) if self.stretch else b""
        if self.name in _FILES:
            return _file(np.concatenate(self._held) if self._held else np.zeros(0, np.float32), self.name)
        if self.name in _RAW:
            return tail
        encoder, self._encoder = self._encoder or Encoder(CODECS[self.name]), None
        return tail + encoder.finish()

    def _run(self, work: Callable[[], bytes]) -> bytes:
        with self._lock:
            if self._closed:
                return b""
            self._busy = True
        try:
            return work()
        finally:
            with self._lock:
                self._busy, closed = False, self._closed
            if closed:
                self._free()

    def _free(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
            self._encoder = None
        self.stretch, self._held = None, []


def encode(pcm: np.ndarray, name: str, speed: float = 1.0) -> bytes:
    """A whole answer's audio as the bytes of format `name`."""
    out = AudioOut(name, speed)
    return out.write(pcm) + out.finish()
