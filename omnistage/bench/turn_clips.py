"""Clips of spoken turns with silences between them, whose speech boundaries are known, for voice-activity
detection: a recorded utterance placed at chosen times in silence, at any sample rate, and noise with no
speech at all.

A turn's truth is the utterance's audible span: from the first to the last 10 ms window whose RMS is within
`AUDIBLE_DB` of full scale (the recording's own leading and trailing silence excluded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr

AUDIBLE_DB = -50.0
_WINDOW_MS = 10


@dataclass(frozen=True)
class TurnClip:
    audio: np.ndarray  # float32 mono at sample_rate
    sample_rate: int
    turns: tuple[tuple[int, int], ...]  # each turn's audible (start_ms, end_ms)


def audible_span(speech: np.ndarray, sample_rate: int) -> tuple[int, int]:
    """The first and last sample (end exclusive) of the windows louder than AUDIBLE_DB."""
    window = sample_rate * _WINDOW_MS // 1000
    frames = speech[: len(speech) - len(speech) % window].reshape(-1, window)
    rms_db = 10 * np.log10(np.mean(frames.astype(np.float64) ** 2, axis=1) + 1e-20)
    loud = np.flatnonzero(rms_db > AUDIBLE_DB)
    if not len(loud):
        raise ValueError("no audible speech in the clip")
    return int(loud[0]) * window, (int(loud[-1]) + 1) * window


def turn_clip(
    speech: np.ndarray,
    speech_rate: int,
    sample_rate: int,
    silences_ms: tuple[int, ...] = (1000, 1500, 1500),
    gains: tuple[float, ...] = (1.0, 0.5),
) -> TurnClip:
    """The utterance's audible span once per gain, with silences_ms before, between and after the turns
    (one more silence than gains); resampled from speech_rate to sample_rate."""
    if len(silences_ms) != len(gains) + 1:
        raise ValueError("one silence before each turn and one after the last")
    start, end = audible_span(speech, speech_rate)
    spoken = np.asarray(speech[start:end], dtype=np.float32)
    if sample_rate != speech_rate:
        spoken = soxr.resample(spoken, speech_rate, sample_rate).astype(np.float32)
    spoken_ms = len(spoken) * 1000 // sample_rate
    pieces, turns, at_ms = [], [], 0
    for silence_ms, gain in zip(silences_ms, gains, strict=False):
        pieces += [np.zeros(sample_rate * silence_ms // 1000, np.float32), gain * spoken]
        at_ms += silence_ms
        turns.append((at_ms, at_ms + spoken_ms))
        at_ms += spoken_ms
    pieces.append(np.zeros(sample_rate * silences_ms[-1] // 1000, np.float32))
    return TurnClip(np.concatenate(pieces), sample_rate, tuple(turns))


def noise_clip(kind: str, seconds: float, sample_rate: int, seed: int = 0) -> np.ndarray:
    """No speech: "white" (Gaussian, -26 dBFS RMS), "hum" (50 Hz mains and its harmonics under faint hiss),
    "clicks" (a keyboard's: 5 ms bursts, 8 a second)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    if kind == "white":
        audio = 0.05 * rng.standard_normal(n)
    elif kind == "hum":
        audio = sum(
            0.1 / k * np.sin(2 * np.pi * 50 * k * t) for k in (1, 2, 3)
        ) + 0.003 * rng.standard_normal(n)
    elif kind == "clicks":
        audio = 0.002 * rng.standard_normal(n)
        burst = sample_rate * 5 // 1000
        for at in rng.integers(0, n - burst, size=int(8 * seconds)):
            audio[at : at + burst] += 0.3 * rng.standard_normal(burst) * np.hanning(burst)
    else:
        raise ValueError(f"unknown noise {kind!r}")
    return np.asarray(audio, dtype=np.float32)
