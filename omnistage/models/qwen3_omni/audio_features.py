"""Audio attachments to the 128-bin log-mel features the audio encoder reads.

`log_mel` computes what the released `WhisperFeatureExtractor` computes for one clip processed alone
(Qwen3-Omni's processor pads to the longest clip of a batch, which changes the last frames of the shorter
clips; we featurise every clip on its own so a clip's features never depend on its batch).
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from typing import overload

import numpy as np
import soundfile as sf
import soxr
import torch
import torch.nn.functional as F

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
# Frames per STFT call. On the CPU 5 s: a call's buffers stay in cache, where a 2-minute clip's whole spectrum
# at once (tens of MB, fresh pages from malloc each time) took 2-3 times as long on one thread. On a GPU a
# minute, every call that size: cuFFT plans a transform per batch size, so one size is planned once instead
# of once per clip length, and the scratch stays ~40 MB however long the clip.
CPU_FRAMES_PER_CALL = 500
GPU_FRAMES_PER_CALL = 6000


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


@overload
def log_mel(
    waveform: torch.Tensor | np.ndarray, device: torch.device | str | None = ..., max_seconds: float = ...
) -> torch.Tensor: ...
@overload
def log_mel(
    waveform: list[torch.Tensor | np.ndarray],
    device: torch.device | str | None = ...,
    max_seconds: float = ...,
) -> list[torch.Tensor]: ...


def log_mel(
    waveform: torch.Tensor | np.ndarray | list[torch.Tensor | np.ndarray],
    device: torch.device | str | None = None,
    max_seconds: float = MAX_SECONDS,
) -> torch.Tensor | list[torch.Tensor]:
    """Whisper log-mel features [128, num_samples // 160] of 16 kHz mono audio, float32, computed on `device`
    (default: where the waveform is) and left there, on the current stream.

    A list of clips gives a list of features, each computed on its own (its own max for the -8 floor).
    """
    if isinstance(waveform, list):
        return [log_mel(w, device, max_seconds) for w in waveform]
    x = clip_waveform(waveform, max_seconds)
    device = torch.device(device) if device is not None else x.device
    if device.type != "cuda":
        return _log_mel(x.to(device), CPU_FRAMES_PER_CALL, same_size_calls=False)
    return _log_mel(x.to(device), GPU_FRAMES_PER_CALL, same_size_calls=True)


def clip_waveform(waveform: torch.Tensor | np.ndarray, max_seconds: float = MAX_SECONDS) -> torch.Tensor:
    """A clip as `log_mel` and `log_mels` read it: a 1-D float32 tensor of 16 kHz samples, long enough for one
    frame and at most `max_seconds` long (InvalidMedia saying what is wrong otherwise), in memory of its own: a
    request's clip is read when the request is admitted, after its caller may have reused the buffer."""
    x = torch.as_tensor(waveform)
    if x.dim() != 1:
        raise InvalidMedia(f"audio must be mono, a 1-D waveform; got shape {tuple(x.shape)}")
    if x.numel() < MIN_SAMPLES:
        raise InvalidMedia(
            f"audio is too short: {x.numel()} samples at {SAMPLE_RATE} Hz, at least {MIN_SAMPLES} are needed"
        )
    _check_duration(x.numel(), SAMPLE_RATE, max_seconds)
    return x.to(dtype=torch.float32, copy=True)


def log_mels(clips: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The features of several clips (`clip_waveform`s, on the host) on `device`, each equal to its `log_mel`
    within float reduction order: one copy of the clips laid end to end, one run of same-size STFT calls on
    the current stream, and nothing waited for. The encoder stage makes an admission's features so
    (`AudioFormat.features`), where the tower reads them."""
    per_call = GPU_FRAMES_PER_CALL if device.type == "cuda" else CPU_FRAMES_PER_CALL
    log_spec, starts, frames = _log_mels([c.numpy() for c in clips], device, per_call)
    return [log_spec[:, int(s) : int(s) + n].contiguous() for s, n in zip(starts, frames)]


def _log_mels(
    clips: list[np.ndarray], device: torch.device, per_call: int
) -> tuple[torch.Tensor, np.ndarray, list[int]]:
    """The features of several float32 waveforms on `device`, laid end to end: clip i's are columns
    `starts[i]` to `starts[i] + frames[i]`, and equal `_log_mel(clip, per_call, same_size_calls=True)`. One
    copy to the device, one run of same-size STFT calls.

    Each clip is padded as torch.stft centres it and the clips are laid end to end, each starting at a whole
    hop: then a clip's frames are frames of the joint signal (a frame reads its 400 samples, all within its
    clip's padding), and the frames across two clips are computed and dropped. Each clip keeps its own max
    for the -8 floor.
    """
    half = N_FFT // 2
    frames = [c.size // HOP_LENGTH for c in clips]  # Whisper drops the last frame of the centred STFT
    spans = [-(-(c.size + N_FFT) // HOP_LENGTH) for c in clips]  # each clip's padded length, in whole hops
    starts = np.concatenate([[0], np.cumsum(spans)])
    calls = -(-int(starts[-1]) // per_call)
    # The clips and the silence between them cross; the silence after them, up to the last call's end (most of
    # a call when an admission brings a few seconds), is zeroed where the STFT reads it.
    used = int(starts[-2]) * HOP_LENGTH + clips[-1].size + N_FFT
    # built in pinned memory and copied without blocking: from pageable memory the copy is a synchronous
    # staged transfer, which waits for every step queued on the stream
    pinned = device.type == "cuda"
    joint_t = torch.empty(used, pin_memory=pinned)
    owner_t = torch.full((calls * per_call,), len(clips), dtype=torch.int64, pin_memory=pinned)
    joint, owner = joint_t.numpy(), owner_t.numpy()  # frames across two clips: owner's extra slot
    end = 0
    for i, (clip, start, n) in enumerate(zip(clips, starts, frames)):
        offset = int(start) * HOP_LENGTH
        joint[end:offset] = 0.0  # the silence since the clip before
        joint[offset : offset + half] = clip[half:0:-1]  # torch.stft's centring: reflected at both ends
        joint[offset + half : offset + half + clip.size] = clip
        joint[offset + half + clip.size : offset + clip.size + N_FFT] = clip[-2 : -half - 2 : -1]
        owner[start : start + n] = i
        end = offset + clip.size + N_FFT
    x = torch.empty((calls * per_call - 1) * HOP_LENGTH + N_FFT, device=device)
    x[:used].copy_(joint_t, non_blocking=True)
    x[used:].zero_()
    owners = owner_t.to(device, non_blocking=True)
    window, filters = _window(str(device)), _mel_filters(NUM_MEL_BINS, str(device))
    log_spec = torch.empty(NUM_MEL_BINS, calls * per_call, device=device)
    for call in range(calls):
        first = call * per_call
        piece = x[first * HOP_LENGTH : (first + per_call - 1) * HOP_LENGTH + N_FFT]
        spec = torch.stft(piece, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
        ri = torch.view_as_real(spec.mT)  # |z|^2 as in _log_mel
        power = torch.addcmul(ri[..., 0].square(), ri[..., 1], ri[..., 1])
        log_spec[:, first : first + per_call] = (filters @ power.mT).clamp_(min=1e-10).log10_()
    peaks = torch.full((len(clips) + 1,), -torch.inf, device=device)
    peaks.scatter_reduce_(0, owners, log_spec.amax(dim=0), "amax")
    torch.maximum(log_spec, (peaks - 8.0)[owners][None], out=log_spec)
    return log_spec.add_(4.0).div_(4.0), starts, frames


def _log_mel(x: torch.Tensor, per_call: int, same_size_calls: bool) -> torch.Tensor:
    """The features of a float32 waveform on its device, on the current stream, `per_call` frames per STFT;
    `same_size_calls`: the last call too, its input padded with silence and its extra frames dropped."""
    device = x.device
    frames = x.numel() // HOP_LENGTH  # Whisper drops the last frame of the centred STFT
    padded = F.pad(x[None], (N_FFT // 2, N_FFT // 2), mode="reflect")[0]  # torch.stft's centring
    if same_size_calls:
        calls = -(-frames // per_call)
        padded = F.pad(padded, (0, max(0, (calls * per_call - 1) * HOP_LENGTH + N_FFT - padded.numel())))
    window, filters = _window(str(device)), _mel_filters(NUM_MEL_BINS, str(device))
    log_spec = torch.empty(NUM_MEL_BINS, frames, device=device)
    for start in range(0, frames, per_call):
        kept = min(per_call, frames - start)
        span = per_call if same_size_calls else kept
        piece = padded[start * HOP_LENGTH : (start + span - 1) * HOP_LENGTH + N_FFT]
        spec = torch.stft(piece, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
        # |z|^2 as re^2 + im^2 over [frames, freq] rows, as the STFT lays them out: abs() takes a square
        # root only to square it again, and reads the transposed spectrum at a third of the speed
        ri = torch.view_as_real(spec.mT)
        power = torch.addcmul(ri[..., 0].square(), ri[..., 1], ri[..., 1])
        log_spec[:, start : start + kept] = (filters @ power.mT)[:, :kept].clamp_(min=1e-10).log10_()
    torch.maximum(log_spec, log_spec.max() - 8.0, out=log_spec)
    return log_spec.add_(4.0).div_(4.0)


def _check_duration(num_samples: int, sample_rate: int, max_seconds: float) -> None:
    seconds = num_samples / sample_rate
    if seconds > max_seconds:
        raise InvalidMedia(f"audio is too long: {seconds:.1f} s, the limit is {max_seconds:g} s per clip")


@lru_cache(maxsize=8)
def _window(device: str) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)


@lru_cache(maxsize=8)
def _mel_filters(num_mel_bins: int, device: str) -> torch.Tensor:
    """[num_mel_bins, 1 + n_fft/2] triangular filters, Slaney mel scale and Slaney area norm, 0-8 kHz.

    On the CPU a sparse COO tensor: 394 of the 25,728 weights are not zero, and the dense product, 98% of
    its multiplies by zero, took 4 of a 2-minute clip's 16 ms on one thread. A GPU's dense GEMM takes
    microseconds.
    """
    fft_freqs = torch.linspace(0, SAMPLE_RATE // 2, 1 + N_FFT // 2, dtype=torch.float64)
    mels = torch.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), num_mel_bins + 2, dtype=torch.float64)
    edges = _mel_to_hz(mels)
    widths = edges.diff()
    slopes = edges[None, :] - fft_freqs[:, None]  # [freq, edge]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    filters = filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    filters = filters.T.to(device=device, dtype=torch.float32).contiguous()
    return filters.to_sparse().coalesce() if filters.device.type == "cpu" else filters


# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4).
_MIN_LOG_HZ, _MIN_LOG_MEL, _LOG_STEP = 1000.0, 15.0, math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    return 3.0 * hz / 200.0 if hz < _MIN_LOG_HZ else _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOG_STEP


def _mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    linear = 200.0 * mels / 3.0
    log = _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mels - _MIN_LOG_MEL))
    return torch.where(mels >= _MIN_LOG_MEL, log, linear)
