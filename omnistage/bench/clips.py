"""The audio a benchmark feeds: wav files from a directory, or clips synthesised to given durations.

Synthetic clips use espeak-ng where it is installed (real, if robotic, speech) and otherwise a
speech-like signal: voiced syllables (a pitch contour's harmonics shaped by vowel formants) and
fricative noise bursts, in words separated by pauses. With random weights the content does not matter,
only the duration does; with a real model, espeak-ng clips give transcripts to read.

A benchmark sends each clip as its requests' own (`Clip.heard_as`): a faint dither numbered by the request
over the clip's first half second, so that no two requests are the same bytes. The server's caches (the audio
tower's rows of a clip seen before, the prefix cache's pages) then find nothing a real stream of distinct
recordings would not give them; a set of 20 clips cycled over thousands of requests would otherwise measure
cache hits.
"""

from __future__ import annotations

import io
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
DITHER = 3e-4  # a dither's RMS (about -70 dBFS; 10 pcm16 steps): inaudible, and no two seeds alike
DISTINCT_S = 0.5  # the span of a clip a request's own dither covers: the audio tower's first window

# 20 utterance durations (s) spread like LibriSpeech test-clean's (right-skewed: many 2-5 s utterances,
# a tail past 10 s), 94 s in total as the benchmark's issue specifies.
LIBRISPEECH_TEST_CLEAN_DURATIONS = (
    1.9, 2.3, 2.6, 2.9, 3.1, 3.3, 3.5, 3.7, 3.9, 4.1,
    4.3, 4.6, 4.9, 5.2, 5.6, 6.0, 6.6, 7.4, 8.6, 9.5,
)  # fmt: skip

# "5s": the reference point for TTFT (a 5 s clip answered with 33 tokens); "2min": one 2-minute clip, the
# length long-form ASR figures are quoted at.
SYNTH_SETS = {"librispeech": LIBRISPEECH_TEST_CLEAN_DURATIONS, "5s": (5.0,), "2min": (120.0,)}

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "She sells sea shells by the sea shore every summer morning.",
    "A journey of a thousand miles begins with a single step.",
    "The weather today is cloudy with a chance of light rain in the evening.",
    "Please remember to bring your notebook and a pen to the meeting.",
    "Most of the trains were late because of the heavy snow last night.",
    "He opened the window and listened to the birds in the garden.",
    "Our library closes at nine o'clock on weekdays and at noon on Sundays.",
)


@dataclass(frozen=True)
class Clip:
    name: str
    audio: np.ndarray  # float32 mono at 16 kHz
    transcript: str | None = None

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    def heard_as(self, number: int, run: int = 0) -> Clip:
        """This clip as request `number` (any int, the warm-up's negative) of benchmark run `run` sends it: its
        first DISTINCT_S seconds with their dither. A run against a server that outlives it takes a number of
        its own, so that its requests are not an earlier run's either."""
        return replace(self, audio=dithered(self.audio, (run, number), DISTINCT_S * SAMPLE_RATE))

    def wav_bytes(self) -> bytes:
        import soundfile as sf

        buffer = io.BytesIO()
        sf.write(buffer, self.audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
        return buffer.getvalue()


def dithered(audio: np.ndarray, seed: int | tuple[int, ...], samples: float | None = None) -> np.ndarray:
    """A float32 copy of `audio` with a dither of `seed` (any ints; RMS DITHER) over its first `samples` (all of
    it when None)."""
    out = np.array(audio, dtype=np.float32)
    n = len(out) if samples is None else min(len(out), round(samples))
    entropy = [s % 2**63 for s in (seed if isinstance(seed, tuple) else (seed,))]
    out[:n] += (np.random.default_rng(entropy).standard_normal(n) * DITHER).astype(np.float32)
    return out


def total_seconds(clips: list[Clip]) -> float:
    return sum(c.seconds for c in clips)


def load_dir(directory: str | Path) -> list[Clip]:
    """Every .wav (and .flac) file of `directory`, sorted by name, decoded and resampled to 16 kHz mono."""
    from omnistage.models.qwen3_omni.audio_features import decode_audio, resample

    paths = sorted(p for p in Path(directory).iterdir() if p.suffix.lower() in (".wav", ".flac"))
    if not paths:
        raise FileNotFoundError(f"{directory}: no .wav or .flac files")
    clips = []
    for path in paths:
        samples, rate = decode_audio(path.read_bytes())
        text = path.with_suffix(".txt")
        clips.append(
            Clip(path.stem, resample(samples, rate), text.read_text().strip() if text.exists() else None)
        )
    return clips


def synth_clips(
    durations: tuple[float, ...] | list[float], seed: int = 0, espeak: bool | None = None
) -> list[Clip]:
    """One clip per duration; espeak-ng speech if `espeak` (default: when installed), else speech-like."""
    use_espeak = shutil.which("espeak-ng") is not None if espeak is None else espeak
    clips = []
    for i, seconds in enumerate(durations):
        if use_espeak:
            audio, text = espeak_clip(seconds, i)
        else:
            audio, text = speech_like(seconds, seed + i), None
        clips.append(Clip(f"synth-{i:02d}-{seconds:.1f}s", audio, text))
    return clips


def espeak_clip(seconds: float, index: int) -> tuple[np.ndarray, str]:
    """espeak-ng reading sentences (starting at the `index`-th) until `seconds` are filled, cut to length."""
    from omnistage.models.qwen3_omni.audio_features import decode_audio, resample

    target = round(seconds * SAMPLE_RATE)
    pieces: list[np.ndarray] = []
    said: list[str] = []
    k = index
    while sum(len(p) for p in pieces) < target:
        sentence = _SENTENCES[k % len(_SENTENCES)]
        k += 1
        wav = subprocess.run(
            ["espeak-ng", "-v", "en-us", "-s", "165", "--stdout", sentence], capture_output=True, check=True
        ).stdout
        samples, rate = decode_audio(wav)
        pieces.append(resample(samples, rate))
        said.append(sentence)
    audio = np.concatenate(pieces)[:target]
    return _fade(audio), " ".join(said)


# (F1, F2, F3) in Hz of a few vowels: the spectral peaks that make a harmonic series sound like speech.
_VOWEL_FORMANTS = (
    (730, 1090, 2440),
    (270, 2290, 3010),
    (300, 870, 2240),
    (530, 1840, 2480),
    (570, 840, 2410),
)


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """A deterministic speech-like signal of `seconds`: syllables at ~4 Hz in words, pitch 90-220 Hz."""
    rng = np.random.default_rng(seed)
    n = round(seconds * SAMPLE_RATE)
    out = np.zeros(n, dtype=np.float64)
    f0_base = rng.uniform(100, 180)
    pos = int(rng.uniform(0.05, 0.2) * SAMPLE_RATE)
    while pos < n:
        for _ in range(rng.integers(1, 4)):  # syllables of one word
            length = int(rng.uniform(0.12, 0.26) * SAMPLE_RATE)
            if pos + length > n:
                break
            t = np.arange(length) / SAMPLE_RATE
            if rng.random() < 0.25:  # a fricative: shaped noise
                syllable = rng.standard_normal(length) * 0.08
                syllable = np.diff(syllable, prepend=0.0)  # tilt towards high frequencies
            else:
                syllable = _voiced(t, f0_base * rng.uniform(0.85, 1.2), rng)
            envelope = np.sin(np.pi * np.arange(length) / length) ** 2
            out[pos : pos + length] += syllable * envelope
            pos += length
        pos += int(rng.uniform(0.03, 0.25) * SAMPLE_RATE)  # the pause between words
    out += rng.standard_normal(n) * 1e-3  # a quiet room, not digital silence
    peak = np.abs(out).max()
    return _fade((0.5 * out / peak if peak > 0 else out).astype(np.float32))


def _voiced(t: np.ndarray, f0: float, rng: np.random.Generator) -> np.ndarray:
    contour = f0 * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(1, 3) * t))  # intonation
    phase = 2 * np.pi * np.cumsum(contour) / SAMPLE_RATE
    formants = _VOWEL_FORMANTS[rng.integers(len(_VOWEL_FORMANTS))]
    signal = np.zeros_like(t)
    for k in range(1, int(4000 // f0)):
        freq = k * f0
        gain = sum(1.0 / (1.0 + ((freq - f) / (0.08 * f + 50)) ** 2) for f in formants)
        signal += gain / k * np.sin(k * phase)
    return signal


def _fade(audio: np.ndarray, ms: float = 10.0) -> np.ndarray:
    """Ramp the ends so a cut clip does not start or stop with a click."""
    n = min(len(audio) // 2, int(ms * SAMPLE_RATE / 1000))
    if n:
        ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
        audio = audio.copy()
        audio[:n] *= ramp
        audio[-n:] *= ramp[::-1]
    return audio.astype(np.float32, copy=False)
