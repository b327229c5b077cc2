"""Audio attachments to the 128-bin log-mel features the audio encoder reads.

`log_mel` computes what the released `WhisperFeatureExtractor` computes for one clip processed alone
(Qwen3-Omni's processor pads to the longest clip of a batch, which changes the last frames of the shorter
clips; we featurise every clip on its own so a clip's features never depend on its batch).
"""

from __future__ import annotations

import io
import math
from functools import lru_cache

import numpy as np
import soundfile as sf
import soxr
import torch

from omnistage.errors import InvalidMedia

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
NUM_MEL_BINS = 128
# The released preprocessor_config.json declares chunk_length 300 s (n_samples 4,800,000, nb_max_frames
# 30,000). transformers' Qwen3-Omni processor calls the extractor with truncation=False, so it never
# enforces it; we do, so one request cannot hold the encoder for minutes.
MAX_SECONDS = 300.0
# torch.stft's centred reflect padding needs more than n_fft // 2 samples; that is one mel frame.
MIN_SAMPLES = N_FFT // 2 + 1


def decode_audio(data: bytes, max_seconds: float = MAX_SECONDS) -> tuple[np.ndarray, int]:
    """Decode a wav/flac/ogg (and mp3 where libsndfile has it) file to float32 mono and its sample rate."""
    if not data:
        raise InvalidMedia("audio is empty (0 bytes)")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sample_rate, frames = f.samplerate, f.frames
            if sample_rate <= 0:
                raise InvalidMedia(f"audio declares an invalid sample rate {sample_rate}")
            _check_duration(frames, sample_rate, max_seconds)
            samples = f.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        # libsndfile's own words: str() of its error names the file object, a memory address here
        reason = exc.error_string if isinstance(exc, sf.LibsndfileError) else exc
        raise InvalidMedia(
            f"audio could not be decoded (wav, flac, ogg, mp3 are accepted): {reason}"
        ) from None
    if samples.shape[0] == 0:
        raise InvalidMedia("audio holds no samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if not np.isfinite(mono).all():
        raise InvalidMedia("audio holds NaN or infinite samples")
    return np.ascontiguousarray(mono), sample_rate


def resample(x: np.ndarray, sample_rate: int, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Resample float32 mono audio with soxr (high quality, as librosa's default `soxr_hq`)."""
    if sample_rate == target_rate:
        return x.astype(np.float32, copy=False)
    return soxr.resample(x, sample_rate, target_rate, quality="HQ").astype(np.float32, copy=False)


def log_mel(
    waveform: torch.Tensor | np.ndarray | list[torch.Tensor | np.ndarray],
    device: torch.device | str | None = None,
    max_seconds: float = MAX_SECONDS,
) -> torch.Tensor | list[torch.Tensor]:
    """Whisper log-mel features [128, num_samples // 160] of 16 kHz mono audio, float32, on `device`.

    A list of clips gives a list of features, each computed on its own (its own max for the -8 floor).
    """
    if isinstance(waveform, list):
        return [log_mel(w, device, max_seconds) for w in waveform]
    x = torch.as_tensor(waveform)
    if x.dim() != 1:
        raise InvalidMedia(f"audio must be mono, a 1-D waveform; got shape {tuple(x.shape)}")
    if x.numel() < MIN_SAMPLES:
        raise InvalidMedia(
            f"audio is too short: {x.numel()} samples at {SAMPLE_RATE} Hz, at least {MIN_SAMPLES} are needed"
        )
    _check_duration(x.numel(), SAMPLE_RATE, max_seconds)
    device = torch.device(device) if device is not None else x.device
    x = x.to(device=device, dtype=torch.float32)
    window = torch.hann_window(N_FFT, device=device)
    spec = torch.stft(x, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = (spec[:, :-1].abs() ** 2).contiguous()
    mel = _mel_filters(NUM_MEL_BINS, str(device)) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _check_duration(num_samples: int, sample_rate: int, max_seconds: float) -> None:
    seconds = num_samples / sample_rate
    if seconds > max_seconds:
        raise InvalidMedia(f"audio is too long: {seconds:.1f} s, the limit is {max_seconds:g} s per clip")


@lru_cache(maxsize=8)
def _mel_filters(num_mel_bins: int, device: str) -> torch.Tensor:
    """[num_mel_bins, 1 + n_fft/2] triangular filters, Slaney mel scale and Slaney area norm, 0-8 kHz."""
    fft_freqs = torch.linspace(0, SAMPLE_RATE // 2, 1 + N_FFT // 2, dtype=torch.float64)
    mels = torch.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), num_mel_bins + 2, dtype=torch.float64)
    edges = _mel_to_hz(mels)
    widths = edges.diff()
    slopes = edges[None, :] - fft_freqs[:, None]  # [freq, edge]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    filters = filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return filters.T.to(device=device, dtype=torch.float32).contiguous()


# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4).
_MIN_LOG_HZ, _MIN_LOG_MEL, _LOG_STEP = 1000.0, 15.0, math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    return 3.0 * hz / 200.0 if hz < _MIN_LOG_HZ else _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOG_STEP


def _mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    linear = 200.0 * mels / 3.0
    log = _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mels - _MIN_LOG_MEL))
    return torch.where(mels >= _MIN_LOG_MEL, log, linear)
