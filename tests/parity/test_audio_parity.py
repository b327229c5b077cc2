"""Mel features and the audio encoder against transformers (float32, CPU, tiny random checkpoint)."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from omnistage.bench.hf_layout import audio_tower
from omnistage.errors import InvalidMedia
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens, load_audio_encoder
from omnistage.models.qwen3_omni.audio_features import (
    CPU_FRAMES_PER_CALL,
    GPU_FRAMES_PER_CALL,
    _log_mel,
    _log_mels,
    decode_audio,
    log_mel,
    log_mels,
    resample,
)
from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG, make_tiny

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
MEL_TOLERANCE = 1e-4  # max abs, features are O(1)
ENCODER_TOLERANCE = 1e-4  # max abs error relative to the reference's max abs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_tower(checkpoint):
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return audio_tower(model.thinker).eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_audio_encoder(checkpoint, LoadOptions(torch.float32, "cpu"))


def whisper_features(waveform: np.ndarray) -> np.ndarray:
    """The released extractor, called as Qwen3-Omni's processor calls it (padding to the longest, no truncation)."""
    keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value", "dither")
    extractor = WhisperFeatureExtractor(**{k: PREPROCESSOR_CONFIG[k] for k in keys})
    kwargs = {"padding": True, "truncation": False, "return_attention_mask": True, "return_tensors": "np"}
    out = extractor(waveform, sampling_rate=16000, **kwargs)
    return out["input_features"][0][:, : int(out["attention_mask"][0].sum())]


def sine_and_noise(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    noise = np.random.default_rng(seed).standard_normal(n)
    tones = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1730 * t)
    return (tones + 0.05 * noise).astype(np.float32)


def speech_fixture() -> np.ndarray:
    waveform, rate = decode_audio(SPEECH.read_bytes())
    assert rate == 16000
    return waveform


def check_mel(waveform: np.ndarray) -> None:
    ours = log_mel(torch.from_numpy(waveform)).numpy()
    ref = whisper_features(waveform)
    assert ours.shape == ref.shape == (128, len(waveform) // 160)
    assert np.abs(ours - ref).max() <= MEL_TOLERANCE


def test_mel_matches_whisper_on_committed_speech():
    check_mel(speech_fixture())


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_mel_matches_whisper_on_fresh_espeak_speech(tmp_path):
    wav = tmp_path / "speech.wav"
    text = "Omnistage turns speech into tokens, one chunk of audio at a time."
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(wav), text], check=True, capture_output=True)
    waveform, rate = decode_audio(wav.read_bytes())
    check_mel(resample(waveform, rate, 16000))


def test_mel_matches_whisper_on_sine_and_noise():
    check_mel(sine_and_noise(2.3456))


def test_mel_of_a_list_is_each_clip_alone():
    clips = [sine_and_noise(1.01, seed=1), speech_fixture()]
    for batched, clip in zip(log_mel([torch.from_numpy(c) for c in clips]), clips):
        assert torch.equal(batched, log_mel(torch.from_numpy(clip)))


def test_mel_on_the_cpu_device_argument_equals_the_default():
    clip = torch.from_numpy(speech_fixture())
    assert torch.equal(log_mel(clip, device="cpu"), log_mel(clip))
    assert torch.equal(log_mel(clip, device=torch.device("cpu")), log_mel(clip.numpy()))


@pytest.mark.parametrize("per_call", [7, GPU_FRAMES_PER_CALL])
def test_mel_in_same_size_calls_equals_the_cpu_calls(per_call):
    """The GPU's plan of STFT calls (every call `per_call` frames, the last padded with silence) on the CPU:
    the same frames as the CPU's plan and transformers', at any length against a call's size."""
    for samples in (4000, 160 * 3 * per_call, 160 * 3 * per_call + 159, 160 * (3 * per_call + 1) + 17):
        clip = sine_and_noise(samples / 16000, seed=samples)
        ours = _log_mel(torch.from_numpy(clip), per_call, same_size_calls=True)
        cpu = _log_mel(torch.from_numpy(clip), CPU_FRAMES_PER_CALL, same_size_calls=False)
        assert ours.shape == cpu.shape == (128, samples // 160)
        assert (ours - cpu).abs().max() <= 1e-6  # the same arithmetic per frame; only the FFT batch differs
        assert np.abs(ours.numpy() - whisper_features(clip)).max() <= MEL_TOLERANCE


@pytest.mark.parametrize("per_call", [7, GPU_FRAMES_PER_CALL])
def test_clips_laid_end_to_end_are_each_their_own_features(per_call):
    """The GPU's batch of clips (`_log_mels`) on the CPU: each clip's frames, and its own floor, exactly as the
    clip alone in the same calls, whatever its length against a hop and a call (the loudest next to the
    quietest: a shared max would floor the quiet one)."""
    lengths = (201, 4000, 160 * 3 * per_call + 159, 16000 * 7 + 17, 160 * per_call)
    clips = [sine_and_noise(n / 16000, seed=n) * (0.01 if i == 1 else 1.0) for i, n in enumerate(lengths)]
    clips = [c.astype(np.float32) for c in clips]
    joint, starts, frames = _log_mels(clips, torch.device("cpu"), per_call)
    for clip, start, n in zip(clips, starts, frames):
        features = joint[:, int(start) : int(start) + n]
        alone = _log_mel(torch.from_numpy(clip), per_call, same_size_calls=True)
        assert features.shape == alone.shape == (128, clip.size // 160)
        assert (
            features - alone
        ).abs().max() <= 1e-6  # the same arithmetic per frame; only the FFT batch differs


def test_clips_featurised_together_are_each_their_log_mel():
    """`log_mels`, the encoder stage's features of an admission's waveforms, against each clip's `log_mel`."""
    clips = [torch.from_numpy(sine_and_noise(s, seed=i)) for i, s in enumerate((0.0126, 3.3, 0.5, 12.04))]
    for features, clip in zip(log_mels(clips, torch.device("cpu")), clips):
        alone = log_mel(clip)
        assert features.shape == alone.shape and features.is_contiguous()
        assert (features - alone).abs().max() <= 1e-6


def test_a_clip_featurised_with_others_gets_the_same_bits_anywhere_in_the_batch():
    """A clip's features do not depend on the clips admitted with it, nor on its place among them: the prefix
    cache keys pages by the rows they give, and a realtime turn's early prefill hits only where they are equal."""
    rng = np.random.default_rng(0)
    a, b, c = (
        torch.from_numpy((0.3 * rng.standard_normal(n)).astype(np.float32))
        for n in (144_000, 52_017, 300_000)
    )
    alone = log_mels([a], torch.device("cpu"))[0]
    assert torch.equal(log_mels([b, a, c], torch.device("cpu"))[1], alone)
    assert torch.equal(log_mels([c, b, a], torch.device("cpu"))[2], alone)


def test_bad_audio_raises_invalid_media():
    with pytest.raises(InvalidMedia, match="empty"):
        decode_audio(b"")
    with pytest.raises(InvalidMedia, match="could not be decoded") as corrupt:
        decode_audio(b"RIFF this is not a wave file")
    assert "object at 0x" not in str(corrupt.value)  # libsndfile's reason, not the buffer's repr
    buf = io.BytesIO()
    sf.write(buf, np.zeros(301 * 1000, np.float32), 1000, format="WAV")  # 301 s at 1 kHz: small but too long
    with pytest.raises(InvalidMedia, match="limit is 300 s"):
        decode_audio(buf.getvalue())
    with pytest.raises(InvalidMedia, match="too short"):
        log_mel(torch.zeros(100))


def test_output_token_count_matches_transformers():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.arange(1, 3001)
    expected = _get_feat_extract_output_lengths(frames, 50).tolist()
    assert [audio_output_tokens(int(n)) for n in frames] == expected


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_encoder_matches_transformers_on_clips_of_different_lengths(ours, hf_tower):
    # 12.34 s (two 8 s attention windows, not a whole number of 1 s chunks), 3 s of speech, 5 s.
    features = [log_mel(torch.from_numpy(sine_and_noise(12.34))), log_mel(torch.from_numpy(speech_fixture()))]
    features.append(log_mel(torch.from_numpy(sine_and_noise(5.0, seed=2))))
    assert [f.shape[1] for f in features] == [1234, 297, 500]

    batched = ours(features)
    for feats, out in zip(features, batched):
        ref = hf_tower(feats, feature_lens=torch.tensor([feats.shape[1]])).last_hidden_state
        assert out.shape == ref.shape == (audio_output_tokens(feats.shape[1]), ours.cfg.output_dim)
        assert relative_error(out, ref) <= ENCODER_TOLERANCE
        assert relative_error(out, ours([feats])[0]) <= 1e-5  # the ragged batch is each clip alone

    lengths = torch.tensor([f.shape[1] for f in features])
    ref_packed = hf_tower(torch.cat(features, dim=1), feature_lens=lengths).last_hidden_state
    packed = ours(torch.cat(features, dim=1), lengths)
    assert relative_error(packed, ref_packed) <= ENCODER_TOLERANCE
    assert torch.equal(packed, torch.cat(batched))


@torch.no_grad()
def test_clip_under_one_second_matches_transformers_batched_with_a_full_chunk(ours, hf_tower):
    # We pad every chunk to 100 frames; transformers pads to its batch's longest chunk, so a lone clip
    # shorter than 1 s differs there (~2% here). Beside any clip of 1 s or more it is padded as ours.
    short = log_mel(torch.from_numpy(sine_and_noise(0.57, seed=3)))
    long = log_mel(torch.from_numpy(sine_and_noise(1.5, seed=4)))
    lengths = torch.tensor([short.shape[1], long.shape[1]])
    ref = hf_tower(torch.cat([short, long], dim=1), feature_lens=lengths).last_hidden_state
    out = ours([short])[0]
    assert relative_error(out, ref[: out.shape[0]]) <= ENCODER_TOLERANCE
