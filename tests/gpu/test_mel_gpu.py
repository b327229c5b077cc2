"""Log-mel features on a GPU: the CPU's features, made on a stream of their own without waiting for the work
queued on the engine's stream, from several threads at once and in batches, returned to the host so that
requests holding them hold no GPU memory."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from omnistage.models.qwen3_asr.processor import ASRProcessor
from omnistage.models.qwen3_asr.tiny import make_tiny
from omnistage.models.qwen3_omni.audio_features import GPU_FRAMES_PER_CALL, log_mel

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
        assert gpu.device.type == "cpu"
        cpu = log_mel(waveform)
        assert gpu.shape == cpu.shape
        assert (gpu.cpu() - cpu).abs().max().item() <= MEL_TOLERANCE, seconds


def test_the_mel_does_not_wait_for_the_engine_stream():
    waveform = clip(120.0)
    want = log_mel(waveform)
    log_mel(waveform, device="cuda")  # cuFFT's plan and the stream, made once
    torch.cuda._sleep(4_000_000_000)  # ~2 s of work queued on this thread's stream, as an engine step's
    started = time.perf_counter()
    got = log_mel(waveform, device="cuda")
    took = time.perf_counter() - started
    assert not torch.cuda.current_stream().query() and took < 0.5  # returned while the stream still ran
    assert (got.cpu() - want).abs().max().item() <= MEL_TOLERANCE  # and its features were complete
    torch.cuda.synchronize()


def test_mels_from_many_threads_are_each_their_clip():
    clips = [clip(seconds, seed=i) for i, seconds in enumerate((3.0, 120.0, 0.7, 45.5, 9.1, 61.0))]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda w: log_mel(w, device="cuda"), clips))
    for waveform, features in zip(clips, got):
        assert (features.cpu() - log_mel(waveform)).abs().max().item() <= MEL_TOLERANCE


def test_a_burst_of_clips_is_featurised_in_batches(monkeypatch):
    """Clips arriving together from many threads share batches (one copy, one run of STFT calls), each still
    its own clip's features."""
    import omnistage.models.qwen3_omni.audio_features as af

    sizes, run = [], af._log_mels
    monkeypatch.setattr(af, "_log_mels", lambda clips, *a: sizes.append(len(clips)) or run(clips, *a))
    clips = [clip(2.0 + (i % 7), seed=i) for i in range(64)]
    log_mel(clips[0], device="cuda")
    sizes.clear()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda w: log_mel(w, device="cuda"), clips))
    assert sum(sizes) == len(clips) and len(sizes) < len(clips) // 2, sizes
    for waveform, features in zip(clips, got):
        assert (features.cpu() - log_mel(waveform)).abs().max().item() <= MEL_TOLERANCE


def test_features_held_by_requests_hold_no_gpu_memory(tmp_path):
    directory = make_tiny(tmp_path / "asr")
    on_gpu, on_cpu = ASRProcessor(directory, device="cuda"), ASRProcessor(directory)
    waveform = clip(120.0)
    a, b = on_gpu.transcription(waveform, "en", None), on_cpu.transcription(waveform, "en", None)
    assert a.token_ids == b.token_ids and a.mm.num_audio_tokens == b.mm.num_audio_tokens
    assert a.mm.audio_features[0].device.type == "cpu"
    assert (a.mm.audio_features[0] - b.mm.audio_features[0]).abs().max().item() <= MEL_TOLERANCE
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    held = [on_gpu.transcription(clip(120.0, seed=i), "en", None) for i in range(16)]  # 6 MB of mel each
    torch.cuda.synchronize()
    assert len(held) == 16 and torch.cuda.memory_allocated() - before < 1 << 20
