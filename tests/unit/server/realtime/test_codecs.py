"""The session's audio formats: pcm16 at 24 kHz exactly, G.711 within its 8-bit companding, and a reply
encoded piece by piece equal to the reply encoded whole."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.server.realtime.codecs import (
    PCM,
    PCMA,
    PCMU,
    AudioEncoder,
    AudioFormat,
    BadAudio,
    to_model_rate,
)


def speech_like(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * 300 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)


def test_pcm16_round_trips_exactly():
    fmt = AudioFormat(PCM)
    audio = np.round(speech_like(0.5, 24_000) * 32768) / 32768
    assert fmt.rate == 24_000 and fmt.as_dict() == {"type": "audio/pcm", "rate": 24_000}
    assert np.array_equal(fmt.decode(AudioEncoder(fmt)(audio)), audio)
    with pytest.raises(BadAudio):
        fmt.decode(b"\x00\x01\x02")


@pytest.mark.parametrize("name", [PCMU, PCMA])
def test_g711_at_8_khz(name):
    fmt = AudioFormat(name)
    audio = speech_like(1.0, 24_000)
    encoder = AudioEncoder(fmt)
    pieces = [encoder(audio[at : at + 1_000]) for at in range(0, len(audio), 1_000)]
    data = b"".join(pieces) + encoder(np.zeros(0, np.float32), last=True)
    assert len(data) == 8_000  # one byte a sample, 8 kHz
    decoded = fmt.decode(data)
    reference = to_model_rate(audio, 24_000)[::2]  # 16 kHz to 8 kHz by taking every other sample
    # G.711's 8-bit companding: a few percent of the signal's level
    assert np.sqrt(np.mean((decoded[100:-100] - reference[100:-100]) ** 2)) < 0.02
    assert fmt.ms(len(decoded)) == 1_000 and fmt.samples(250) == 2_000


def test_to_model_rate():
    assert len(to_model_rate(speech_like(1.0, 24_000), 24_000)) == 16_000
    audio = speech_like(0.1, 16_000)
    assert to_model_rate(audio, 16_000) is audio
