"""Audio attachments to the 128-bin log-mel features the audio encoder reads.

`log_mel` computes what the released `WhisperFeatureExtractor` computes for one clip processed alone
(Qwen3-Omni's processor pads to the longest clip of a batch, which changes the last frames of the shorter
clips; we featurise every clip on its own so a clip's features never depend on its batch).
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
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
# The most audio one batch of GPU mels holds (_MelBatches): the longest clip's, whose scratch one clip needs anyway.
MAX_BATCH_SECONDS = MAX_SECONDS


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
    """Whisper log-mel features [128, num_samples // 160] of 16 kHz mono audio, float32, computed on `device`.

    A list of clips gives a list of features, each computed on its own (its own max for the -8 floor).
    Computed on a CUDA device, the features come back to the host (see `_MelBatches`).
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
    x = x.to(dtype=torch.float32)  # before the copy: a float64 waveform would cross at twice the bytes
    if device.type != "cuda":
        return _log_mel(x.to(device), CPU_FRAMES_PER_CALL, same_size_calls=False)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _mel_batches(device).features(x)


class _MelBatches:
    """The log-mel features of clips from many threads, made together on one device's stream of their own.

    The processor calls `log_mel` from the server's threads while the engine's thread runs steps on its
    stream. The mel runs on a stream of its own and its batches wait for that stream alone: the engine's
    stream is never synchronised, so no step stalls, and the mel does not queue behind a step.

    The features leave the GPU with the batch's wait (`_to_host`), and the encoder copies them back without
    blocking (`EncoderStage`). Kept on the GPU, they stayed there as long as their request: the
    memory plan cannot count them (any number of requests may wait, each with up to `MAX_SECONDS` of audio),
    and 128 two-minute clips in flight held ~0.8 GiB past the plan and ran a fully planned H200 out of
    memory (benchmarks/RESULTS.md, "Qwen3-ASR at c=128, the steady state").

    One thread of its own runs the batches (`_Batches`): the clips that arrive while a batch runs make the
    next one. When the callers' threads took turns at running them, each batch's end handed a lock from
    thread to thread (each hand-off, as we read it, waiting for the GIL behind the engine's thread), and
    Qwen3-ASR's short clips stayed at ~170 requests a second whatever the concurrency; with this thread,
    +41-54% (benchmarks/RESULTS.md, "Under load, a fourth time").
    A batch holds at most `MAX_BATCH_SECONDS` of audio, so the mel's scratch, which the memory plan does not
    count, stays one longest clip's.
    """

    def __init__(self, device: torch.device) -> None:
        # high priority: the mel's few kernels start ahead of a long prefill's queued kernels, not after them
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.device = device
        self._turn = threading.Lock()  # one batch at a time on the stream
        self._batches = _Batches(self._run, MAX_BATCH_SECONDS * SAMPLE_RATE, f"omnistage-mel-{device}")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # made on the caller's stream: a batch of its own, after that stream's work
            with self._turn:
                self.stream.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(self.stream):
                    features = _to_host(
                        _log_mel(x.to(self.device), GPU_FRAMES_PER_CALL, same_size_calls=True)
                    )
            return features
        return self._batches.submit(x.numpy())

    def _run(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        with self._turn, torch.cuda.stream(self.stream):
            return _log_mels(clips, self.device, GPU_FRAMES_PER_CALL)


class _Batches:
    """Clips submitted from many threads, run in batches by a daemon thread of its own: a batch is the
    pending clips from the first, up to `most` samples in all (`_first_within`), and every clip waits for its
    batch alone. `run` maps a batch's samples to their features, in order; what it raises, every clip of
    its batch raises."""

    def __init__(self, run: Callable[[list[np.ndarray]], list[torch.Tensor]], most: float, name: str) -> None:
        self._run = run
        self._most = most
        self._pending: list[_Clip] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, samples: np.ndarray) -> torch.Tensor:
        clip = _Clip(samples)
        with self._arrived:
            self._pending.append(clip)
            self._arrived.notify()
        clip.done.wait()
        if clip.error is not None:
            raise clip.error
        assert clip.features is not None
        return clip.features

    def _serve(self) -> None:
        while True:
            with self._arrived:
                self._arrived.wait_for(lambda: bool(self._pending))
                batch = _first_within(self._pending, self._most)
                del self._pending[: len(batch)]
            try:
                for c, f in zip(batch, self._run([c.samples for c in batch]), strict=True):
                    c.features = f
            except Exception as exc:  # a device error: every clip of the batch gets it
                for c in batch:
                    c.error = exc
            finally:  # no caller waits forever, whatever happened
                for c in batch:
                    c.done.set()


def _to_host(features: torch.Tensor) -> torch.Tensor:
    """Device `features` on the host, once the current stream has made them, in pageable memory: a request
    holds its features for its whole life, so a pinned block per request could never come from the cache of
    freed ones. The encoder stages them through pinned memory of its own (`to_device`)."""
    return features.to("cpu")


@dataclass
class _Clip:
    samples: np.ndarray
    features: torch.Tensor | None = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _first_within(clips: list[_Clip], samples: float) -> list[_Clip]:
    """The longest run of `clips` from the first holding at most `samples` in all (the first one always)."""
    total = 0
    for i, clip in enumerate(clips):
        total += clip.samples.size
        if total > samples and i > 0:
            return clips[:i]
    return clips[:]


def _log_mels(clips: list[np.ndarray], device: torch.device, per_call: int) -> list[torch.Tensor]:
    """The features of several float32 waveforms, each equal to `_log_mel(clip, per_call, same_size_calls=True)`,
    from one copy to `device`, one run of same-size STFT calls and one copy back to the host. Every copy
    back waits for the stream and gives the GIL up, and a thread may wait for it again up to the switch
    interval while the engine's thread runs Python: once for a batch rather than once for each of its clips.

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
    # built in pinned memory and copied without blocking: from pageable memory the copy is a synchronous
    # staged transfer, which py-spy found the mel threads' busiest line (benchmarks/RESULTS.md, "Qwen3-ASR at
    # c=128, the steady state")
    pinned = device.type == "cuda"
    joint_t = torch.zeros((calls * per_call - 1) * HOP_LENGTH + N_FFT, pin_memory=pinned)
    owner_t = torch.full((calls * per_call,), len(clips), dtype=torch.int64, pin_memory=pinned)
    joint, owner = joint_t.numpy(), owner_t.numpy()  # frames across two clips: owner's extra slot
    for i, (clip, start, n) in enumerate(zip(clips, starts, frames)):
        offset = int(start) * HOP_LENGTH
        joint[offset : offset + clip.size + N_FFT] = np.pad(clip, half, mode="reflect")
        owner[start : start + n] = i
    x, owners = joint_t.to(device, non_blocking=True), owner_t.to(device, non_blocking=True)
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
    host = _to_host(log_spec.add_(4.0).div_(4.0))  # one copy and one wait for the batch, not one per clip
    return [host[:, int(s) : int(s) + n].contiguous() for s, n in zip(starts, frames)]


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
def _mel_batches(device: torch.device) -> _MelBatches:
    return _MelBatches(device)


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
