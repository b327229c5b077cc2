"""Spoken audio's encoding: the formats, the progressive encoders, the time-stretch, and freeing mid-stream."""

from __future__ import annotations

import io
import threading

import av
import numpy as np
import pytest
import soundfile

from omnistage.outputs import AUDIO_SAMPLE_RATE
from omnistage.server.audio_out import FORMATS, AudioOut, encode, progressive

PIECE = AUDIO_SAMPLE_RATE * 2 // 25  # one codec frame's samples, as Code2Wav hands them out
LOSSY = ["mp3", "opus", "aac"]


def tone(seconds: float, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def decoded(data: bytes) -> np.ndarray:
    """The file's samples, decoded by FFmpeg and resampled to 24 kHz mono float (Opus decodes at 48 kHz)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_SAMPLE_RATE)
    with av.open(io.BytesIO(data)) as container:
        frames = [out for frame in container.decode(audio=0) for out in resampler.resample(frame)]
    frames += resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


def pitch(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / AUDIO_SAMPLE_RATE)[spectrum.argmax()])


def pieces(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[i : i + PIECE] for i in range(0, len(audio), PIECE)]


def test_every_format_is_encoded_here():
    # PyAV's wheels carry FFmpeg with libmp3lame, libopus and its own AAC encoder.
    assert FORMATS == ("mp3", "opus", "aac", "flac", "wav", "pcm", "pcm16")
    assert [name for name in FORMATS if not progressive(name)] == ["flac", "wav"]


@pytest.mark.parametrize("name", ["wav", "flac"])
def test_lossless_files_hold_the_pcm_samples(name):
    audio = tone(0.3)
    samples, rate = soundfile.read(io.BytesIO(encode(audio, name)), dtype="int16")
    assert rate == AUDIO_SAMPLE_RATE and samples.ndim == 1
    np.testing.assert_array_equal(samples, np.frombuffer(encode(audio, "pcm"), "<i2"))
    np.testing.assert_allclose(samples / 32768, audio, atol=1 / 32768)


def test_pcm_is_raw_little_endian_16_bit_and_clips():
    audio = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0], dtype=np.float32)
    assert np.frombuffer(encode(audio, "pcm"), "<i2").tolist() == [
        0,
        16384,
        -16384,
        32767,
        -32768,
        32767,
        -32768,
    ]
    assert encode(audio, "pcm16") == encode(audio, "pcm")


def test_pcm_of_pieces_concatenated_is_pcm_of_the_whole():
    audio = np.random.default_rng(0).uniform(-1.2, 1.2, 5000).astype(np.float32)
    out = AudioOut("pcm")
    streamed = b"".join(out.write(p) for p in np.split(audio, [7, 1920, 1921, 4000])) + out.finish()
    assert streamed == encode(audio, "pcm")


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_formats_stream_as_the_pieces_come(name):
    audio = tone(2.0)
    out = AudioOut(name)
    sent = [out.write(p) for p in pieces(audio)]
    sent.append(out.finish())
    # mp3 and opus have bytes for the first piece; AAC's encoder holds one 1,024-sample frame back, so its
    # first bytes come with the second.
    first = next(i for i, data in enumerate(sent) if data)
    assert first == (1 if name == "aac" else 0)
    assert sum(map(bool, sent)) >= len(sent) - 2  # bytes with nearly every piece, not all at the end
    samples = decoded(b"".join(sent))
    # mp3 and ADTS carry no record of the encoder's priming samples, so they decode up to ~80 ms longer.
    assert 0 <= len(samples) - len(audio) <= 0.08 * AUDIO_SAMPLE_RATE
    assert pitch(samples) == pytest.approx(440, rel=0.02)
    assert 0.35 < np.abs(samples).max() < 0.65  # the tone came through at its level
    whole = decoded(encode(audio, name))
    assert len(whole) == len(samples)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
@pytest.mark.parametrize("name", ["pcm", "wav", "mp3"])
def test_speed_stretches_the_time_and_keeps_the_pitch(name, speed):
    audio = tone(2.0, hz=300)
    out = AudioOut(name, speed)
    data = b"".join(out.write(p) for p in pieces(audio)) + out.finish()
    samples = np.frombuffer(data, "<i2") / 32768 if name == "pcm" else decoded(data)
    slack = 0.08 * AUDIO_SAMPLE_RATE if name == "mp3" else 0
    assert len(samples) - slack == pytest.approx(len(audio) / speed, rel=0.05, abs=slack)
    assert pitch(samples) == pytest.approx(300, rel=0.03)
    assert encode(audio, name, speed) == data  # the same bytes, streamed or whole


def test_a_stream_closed_midway_frees_its_encoder_and_sends_nothing_more():
    out = AudioOut("mp3", speed=2.0)
    assert b"".join(out.write(p) for p in pieces(tone(0.5))) != b""
    out.close()
    assert out._encoder is None and out.stretch is None
    assert out.write(tone(0.1)) == b"" and out.finish() == b""


def test_closing_while_a_thread_encodes_lets_that_thread_free_it():
    out = AudioOut("opus")
    out.write(tone(0.1))
    inside, go_on = threading.Event(), threading.Event()

    def piece() -> bytes:  # a piece's encoding, held in its thread until the close has happened
        inside.set()
        go_on.wait(5)
        return out._encode(tone(0.5))

    result: list[bytes] = []
    worker = threading.Thread(target=lambda: result.append(out._run(piece)))
    worker.start()
    assert inside.wait(5)
    out.close()  # returns at once: the encoder is busy in the worker
    assert out._encoder is not None
    go_on.set()
    worker.join(5)
    assert result and result[0] != b""  # the piece in flight was finished
    assert out._encoder is None  # and the worker freed the encoder on its way out
