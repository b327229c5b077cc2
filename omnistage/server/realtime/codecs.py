"""A session's audio formats: what `input_audio_buffer.append` carries in, what `response.output_audio.delta`
carries out.

`audio/pcm` is 16-bit little-endian mono at 24 kHz (OpenAI's default both ways); `audio/pcmu` and `audio/pcma`
are G.711 (μ-law, A-law) at 8 kHz, the telephone's, through FFmpeg's codecs in PyAV. Audio coming in is kept
as float32 at its own rate and resampled (soxr) to the 16 kHz the audio encoder reads; audio going out is the
Talker's 24 kHz, resampled to 8 kHz for G.711 by a resampler that keeps its state across a reply's pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import av
import numpy as np
import soxr

from omnistage.outputs import AUDIO_SAMPLE_RATE
from omnistage.server.audio_out import pcm_bytes, quantized

MODEL_RATE = 16_000  # what the processor's audio encoder reads
PCM, PCMU, PCMA = "audio/pcm", "audio/pcmu", "audio/pcma"
_G711 = {PCMU: "pcm_mulaw", PCMA: "pcm_alaw"}


class BadAudio(ValueError):
    """Bytes that are not audio of the session's format."""


@dataclass(frozen=True)
class AudioFormat:
    """One of the formats a session speaks: its name as OpenAI writes it, and its sample rate."""

    name: str

    @property
    def rate(self) -> int:
        return AUDIO_SAMPLE_RATE if self.name == PCM else 8_000

    def as_dict(self) -> dict[str, object]:
        return {"type": self.name, "rate": self.rate} if self.name == PCM else {"type": self.name}

    def decode(self, data: bytes) -> np.ndarray:
        """Float32 samples at this format's rate; raises BadAudio."""
        if self.name == PCM:
            if len(data) % 2:
                raise BadAudio(f"pcm16 audio is whole 2-byte samples; got {len(data)} bytes")
            return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
        context = cast(av.AudioCodecContext, av.CodecContext.create(_G711[self.name], "r"))
        context.sample_rate, context.layout = self.rate, "mono"
        pieces = [frame.to_ndarray().reshape(-1) for frame in context.decode(av.Packet(data))]
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
        return samples.astype(np.float32) / 32768.0

    def ms(self, samples: int) -> int:
        return samples * 1000 // self.rate

    def samples(self, ms: int) -> int:
        return ms * self.rate // 1000


def to_model_rate(audio: np.ndarray, rate: int) -> np.ndarray:
    """A clip at the 16 kHz the audio encoder reads."""
    if rate == MODEL_RATE:
        return audio.astype(np.float32, copy=False)
    return soxr.resample(audio, rate, MODEL_RATE, quality="HQ").astype(np.float32, copy=False)


class Resampling:
    """A stream of pieces resampled as one signal (no seams between pieces)."""

    def __init__(self, source: int, target: int) -> None:
        self.stream = soxr.ResampleStream(source, target, 1, dtype="float32") if source != target else None

    def __call__(self, audio: np.ndarray, last: bool = False) -> np.ndarray:
        if self.stream is None:
            return audio.astype(np.float32, copy=False)
        return self.stream.resample_chunk(audio.astype(np.float32, copy=False), last=last)


class AudioEncoder:
    """One reply's 24 kHz float PCM, piece by piece, as bytes of the output format."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.fmt = fmt
        self.resampling = Resampling(AUDIO_SAMPLE_RATE, fmt.rate)
        self.context: av.AudioCodecContext | None = None
        if fmt.name in _G711:
            self.context = cast(av.AudioCodecContext, av.CodecContext.create(_G711[fmt.name], "w"))
            self.context.sample_rate, self.context.layout, self.context.format = fmt.rate, "mono", "s16"

    def __call__(self, pcm: np.ndarray, last: bool = False) -> bytes:
        if self.context is None:
            return pcm_bytes(pcm)
        samples = quantized(self.resampling(pcm, last))
        if not len(samples):
            return b""
        frame = av.AudioFrame.from_ndarray(samples[None, :], "s16", "mono")
        frame.sample_rate = self.fmt.rate
        return b"".join(bytes(packet) for packet in self.context.encode(frame))
