"""Log-mel features on a GPU: the CPU's features, and an admission's clips featurised together on the
engine's stream (`log_mels`) without waiting for the work queued on it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from omnistage.models.qwen3_omni.audio_features import GPU_FRAMES_PER_CALL, log_mel, log_mels

pytestmark = pytest.mark.gpu

MEL_TOLERANCE = (
    1e-4  # max abs, as against transformers' extractor on the CPU (tests/parity/test_audio_parity.py)
)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1730 * t) + 0.05 * noise).astype(
        np.float32
    )


def test_gpu_features_equal_the_cpu_features():
    call = GPU_FRAMES_PER_CALL / 100  # seconds
    # under one STFT call, exactly one, one and a bit, several and a remainder, 2 minutes
    for seconds in (0.3, call, call + 0.01, 2 * call + 11.77, 120.0):
        waveform = clip(seconds, seed=int(seconds))
        gpu = log_mel(waveform, device="cuda")
        assert gpu.device.type == "cuda"
        cpu = log_mel(waveform)
        assert gpu.shape == cpu.shape
        assert (gpu.cpu() - cpu).abs().max().item() <= MEL_TOLERANCE, seconds


def test_clips_featurised_together_are_each_their_cpu_features():
    clips = [clip(seconds, seed=i) for i, seconds in enumerate((3.0, 120.0, 0.7, 45.5, 9.1, 61.0))]
    got = log_mels([torch.from_numpy(c) for c in clips], torch.device("cuda"))
    for waveform, features in zip(clips, got):
        assert features.device.type == "cuda" and features.is_contiguous()
        assert (features.cpu() - log_mel(waveform)).abs().max().item() <= MEL_TOLERANCE


def test_clips_featurised_together_wait_for_nothing_queued():
    """An admission's features are made behind the step in flight: the host neither waits for it nor
    synchronises, and the features are complete once the stream gets to them."""
    clips = [torch.from_numpy(clip(seconds, seed=i)) for i, seconds in enumerate((4.0, 30.0, 1.5))]
    log_mels(clips, torch.device("cuda"))  # cuFFT's plan, the filters and the pinned blocks, made once
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # ~2 s of work queued on the stream, as an engine step's
    torch.cuda.set_sync_debug_mode("error")
    try:
        started = time.perf_counter()
        got = log_mels(clips, torch.device("cuda"))
        took = time.perf_counter() - started
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.cuda.current_stream().query() and took < 0.5  # returned while the stream still ran
    for waveform, features in zip(clips, got):
        assert (features.cpu() - log_mel(waveform)).abs().max().item() <= MEL_TOLERANCE


def test_a_clip_featurised_with_others_gets_the_same_bits_anywhere_in_the_batch():
    """Every STFT call has the same size and every frame is its own column: a clip's features are bit for bit
    the same alone, first or last in a batch (the prefix cache's keys and a realtime turn's early prefill rely
    on it)."""
    a, b, c = (torch.from_numpy(clip(seconds, seed=i)) for i, seconds in enumerate((9.0, 3.3, 70.0)))
    cuda = torch.device("cuda")
    alone = log_mels([a], cuda)[0]
    assert torch.equal(log_mels([b, a, c], cuda)[1], alone)
    assert torch.equal(log_mels([c, b, a], cuda)[2], alone)
