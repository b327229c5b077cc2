import shutil

import numpy as np
import pytest
import soundfile as sf

from omnistage.bench.clips import (
    DISTINCT_S,
    DITHER,
    LIBRISPEECH_TEST_CLEAN_DURATIONS,
    SAMPLE_RATE,
    load_dir,
    speech_like,
    synth_clips,
    total_seconds,
)


def test_librispeech_set_is_20_clips_of_94_seconds():
    assert len(LIBRISPEECH_TEST_CLEAN_DURATIONS) == 20
    assert sum(LIBRISPEECH_TEST_CLEAN_DURATIONS) == pytest.approx(94.0)
    assert list(LIBRISPEECH_TEST_CLEAN_DURATIONS) == sorted(LIBRISPEECH_TEST_CLEAN_DURATIONS)


def test_speech_like_clips_have_their_durations_and_are_deterministic():
    clips = synth_clips(LIBRISPEECH_TEST_CLEAN_DURATIONS, seed=3, espeak=False)
    assert [c.seconds for c in clips] == pytest.approx(
        list(LIBRISPEECH_TEST_CLEAN_DURATIONS), abs=1 / SAMPLE_RATE
    )
    assert total_seconds(clips) == pytest.approx(94.0)
    again = synth_clips(LIBRISPEECH_TEST_CLEAN_DURATIONS[:2], seed=3, espeak=False)
    assert np.array_equal(again[1].audio, clips[1].audio)
    assert not np.array_equal(speech_like(2.0, 0), speech_like(2.0, 1))


def test_speech_like_sounds_like_speech():
    audio = speech_like(4.0, seed=0)
    assert audio.dtype == np.float32 and np.abs(audio).max() <= 0.5 + 1e-6
    frames = audio[: len(audio) // 400 * 400].reshape(-1, 400)  # 25 ms frames
    energy = (frames**2).mean(axis=1)
    voiced, quiet = (energy > 0.01 * energy.max()).mean(), (energy < 1e-3 * energy.max()).mean()
    assert voiced > 0.4 and quiet > 0.1  # syllables and pauses, neither silence nor a drone
    spectrum = np.abs(np.fft.rfft(audio))
    freqs = np.fft.rfftfreq(len(audio), 1 / SAMPLE_RATE)
    assert spectrum[(freqs > 80) & (freqs < 4000)].sum() > 0.8 * spectrum.sum()  # the speech band


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_espeak_clips_carry_transcripts():
    (clip,) = synth_clips([2.5], espeak=True)
    assert clip.seconds == pytest.approx(2.5) and clip.transcript.startswith("The quick brown fox")
    assert np.abs(clip.audio).max() > 0.05


def test_load_dir_resamples_and_reads_transcripts(tmp_path):
    t = np.arange(22050) / 22050
    sf.write(tmp_path / "b.wav", 0.2 * np.sin(2 * np.pi * 300 * t), 22050)
    sf.write(tmp_path / "a.flac", np.zeros((8000, 2)), 8000)
    (tmp_path / "b.txt").write_text("hello there\n")
    (tmp_path / "notes.md").write_text("ignored")
    a, b = load_dir(tmp_path)
    assert (a.name, a.seconds, a.transcript) == ("a", 1.0, None)
    assert (b.name, b.seconds, b.transcript) == ("b", 1.0, "hello there")
    assert len(b.audio) == SAMPLE_RATE
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .wav or .flac files"):
        load_dir(tmp_path / "empty")


def test_each_request_hears_a_clip_of_its_own():
    """A request's clip differs from every other request's in its first half second (the audio tower's first
    window: the encoder cache's digest and the prefix cache's rows differ), inaudibly, and nowhere else."""
    (clip,) = synth_clips([3.0], seed=0, espeak=False)
    heard = [clip.heard_as(n) for n in (-1, 0, 1, 2)]  # a warm-up's number and three timed ones
    head = round(DISTINCT_S * SAMPLE_RATE)
    assert len({h.wav_bytes() for h in heard}) == 4  # distinct as pcm16 WAV too, as a client sends them
    for h in heard:
        assert h.name == clip.name and h.audio.dtype == np.float32 and len(h.audio) == len(clip.audio)
        assert np.array_equal(h.audio[head:], clip.audio[head:])
        noise = h.audio[:head] - clip.audio[:head]
        assert 0.5 * DITHER < noise.std() < 2 * DITHER  # about -70 dBFS
    assert np.array_equal(clip.heard_as(5).audio, clip.heard_as(5).audio)  # a request's clip is reproducible
