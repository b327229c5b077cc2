"""Speech out's formats, voice checks, and the chunks of /v1/audio/speech and of a spoken chat reply."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import av
import numpy as np
import pytest
import soundfile

from omnistage.errors import QueueFull
from omnistage.outputs import AUDIO_SAMPLE_RATE
from omnistage.request import talker_sampling_defaults
from omnistage.server.audio_out import encode
from omnistage.server.errors import InvalidField, kind_of
from omnistage.server.protocol.speech import VoiceRef
from omnistage.server.responses import Usage
from omnistage.server.speech import (
    CHAT_FORMATS,
    CHAT_STREAM_FORMATS,
    SPEECH_FORMATS,
    AudioCut,
    SpeechStream,
    SpokenChatFormat,
    check_format,
    speech_params,
)
from omnistage.server.spoken_answers import SpokenAnswers
from omnistage.server.voices import Voices

VOICES = Voices.of(("aiden", "chelsie", "ethan"))


def tone(seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    return (amplitude * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def run(call):
    return asyncio.run(call)


def events(chunks: list) -> list[dict]:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def test_the_formats_offered():
    assert SPEECH_FORMATS == ("mp3", "opus", "aac", "flac", "wav", "pcm")
    assert CHAT_FORMATS == ("wav", "flac", "mp3", "opus", "aac", "pcm16")
    assert CHAT_STREAM_FORMATS == ("mp3", "opus", "aac", "pcm16")


@pytest.mark.parametrize("name", ["m4a", "ogg", "PCM", "wav "])
def test_a_format_not_encoded_is_named_with_those_that_are(name):
    with pytest.raises(InvalidField) as err:
        check_format(name, SPEECH_FORMATS, "response_format")
    assert err.value.param == "response_format"
    assert (
        str(err.value)
        == f"response_format: {name!r} is not supported; this server encodes mp3, opus, aac, flac, wav, pcm"
    )


def test_voices_are_checked_against_the_checkpoint():
    talker = talker_sampling_defaults()
    assert speech_params("Ethan", VOICES, "voice", talker).voice == "ethan"
    assert speech_params(VoiceRef(id="chelsie"), VOICES, "voice", talker).voice == "chelsie"
    assert speech_params("aiden", VOICES, "voice", talker).talker is talker
    with pytest.raises(
        InvalidField, match="unknown voice 'bogus'; this model speaks with aiden, chelsie, ethan"
    ):
        speech_params("bogus", VOICES, "audio.voice", talker)
    with pytest.raises(InvalidField, match="it has no talker") as err:
        speech_params("ethan", Voices.of(()), "voice", talker)
    assert err.value.param == "voice"


def test_sse_speech_streams_pcm_deltas_then_done_with_usage():
    stream = SpeechStream("speech-1", "pcm", sse=True)
    assert stream.media_type == "text/event-stream"
    pieces = [tone(0.08), tone(0.0), tone(0.04)]
    chunks = [c for p in pieces for c in run(stream.audio(p))] + run(
        stream.done(input_tokens=9, output_tokens=3)
    )
    *deltas, done = events(chunks)
    assert [d["type"] for d in deltas] == ["speech.audio.delta"] * 2  # the empty piece sends nothing
    audio = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    assert audio == encode(np.concatenate(pieces), "pcm")
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12},
    }


def test_sse_speech_in_a_file_format_sends_the_whole_file_once():
    stream = SpeechStream("speech-1", "wav", sse=True)
    pieces = [tone(0.05), tone(0.05)]
    assert [run(stream.audio(p)) for p in pieces] == [[], []]
    delta, done = events(run(stream.done(input_tokens=4, output_tokens=2)))
    decoded, rate = soundfile.read(io.BytesIO(base64.b64decode(delta["audio"])), dtype="int16")
    np.testing.assert_array_equal(decoded, pcm16(encode(np.concatenate(pieces), "pcm")))
    assert done["type"] == "speech.audio.done"


@pytest.mark.parametrize("name", ["mp3", "opus"])
def test_sse_speech_in_a_lossy_format_sends_each_piece_as_it_is_encoded(name):
    stream = SpeechStream("speech-1", name, sse=True)
    sent = [run(stream.audio(tone(0.08))) for _ in range(10)]
    assert [len(chunks) for chunks in sent] == [1] * 10  # a delta for every piece, none held back
    *tail, done = events(run(stream.done(input_tokens=4, output_tokens=10)))
    data = b"".join(base64.b64decode(e["audio"]) for e in events([c for cs in sent for c in cs]) + tail)
    with av.open(io.BytesIO(data)) as container:
        seconds = sum(f.samples / f.sample_rate for f in container.decode(audio=0))
    assert 0.8 <= seconds < 0.9 and done["type"] == "speech.audio.done"


def test_raw_pcm_speech_streams_bytes_and_cannot_carry_an_error():
    stream = SpeechStream("speech-1", "pcm", sse=False)
    assert stream.media_type == "audio/pcm"
    assert run(stream.audio(tone(0.01))) == [encode(tone(0.01), "pcm")]
    assert run(stream.done(input_tokens=4, output_tokens=1)) == []
    failure = QueueFull("busy")
    with pytest.raises(AudioCut, match="the audio stream of speech-1 broke off: busy"):
        stream.failed(failure, kind_of(failure))


def test_sse_speech_tells_a_failure_as_an_error_event():
    failure = QueueFull("busy")
    (event,) = events(SpeechStream("speech-1", "mp3", sse=True).failed(failure, kind_of(failure)))
    assert event == {
        "type": "error",
        "error": {"message": "busy", "type": "server_overloaded", "param": None, "code": "queue_full"},
    }


def test_a_spoken_chat_streams_transcript_and_pcm16_in_audio_deltas():
    answers = SpokenAnswers(retention_s=60, clock=lambda: 1000.0)
    fmt = SpokenChatFormat("chatcmpl-1", "tiny", include_usage=True, audio_format="pcm16", answers=answers)
    pieces = [tone(0.02), tone(0.03)]
    chunks = fmt.opening() + fmt.delta("Hi", None) + run(fmt.audio(pieces[0])) + fmt.delta("", None)
    chunks += fmt.delta(" there", None) + run(fmt.audio(pieces[1])) + run(fmt.audio(tone(0.0)))
    chunks += run(fmt.audio_end()) + fmt.closing("stop")
    chunks.append(fmt.usage_chunk(Usage.of(5, 2, audio_tokens=4)))
    parsed = events(chunks)
    deltas = [c["choices"][0]["delta"] for c in parsed if c["choices"]]
    assert deltas[0] == {"role": "assistant"}
    audio = [d["audio"] for d in deltas[1:-1]]
    assert audio[0]["id"] == fmt.audio_id and all("id" not in a for a in audio[1:])
    assert "".join(a.get("transcript", "") for a in audio) == "Hi there"
    data = b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a)
    assert data == encode(np.concatenate(pieces), "pcm16")
    assert audio[-1] == {"expires_at": 1060}  # the last audio delta holds the expiry alone
    assert answers.transcript(fmt.audio_id) == "Hi there"  # kept for a later turn until then
    assert deltas[-1] == {} and parsed[-2]["choices"][0]["finish_reason"] == "stop"
    assert parsed[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"text_tokens": 2, "audio_tokens": 4},
    }


def test_a_spoken_chat_response_has_audio_and_no_content():
    answers = SpokenAnswers(retention_s=3600)
    fmt = SpokenChatFormat("chatcmpl-1", "tiny", include_usage=False, audio_format="wav", answers=answers)
    audio = tone(0.1)
    body = fmt.spoken_response("Hello", "length", Usage.of(3, 1, audio_tokens=2), audio)
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] is None
    assert set(message["audio"]) == {"id", "data", "expires_at", "transcript"}
    assert message["audio"]["transcript"] == "Hello" and message["audio"]["id"] == fmt.audio_id
    assert body["created"] + 3600 <= message["audio"]["expires_at"] <= body["created"] + 3602
    assert answers.transcript(fmt.audio_id) == "Hello"  # a later turn may give it by its id
    decoded, rate = soundfile.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="int16")
    assert rate == AUDIO_SAMPLE_RATE
    np.testing.assert_array_equal(decoded, pcm16(encode(audio, "pcm")))
    assert body["usage"]["completion_tokens_details"] == {"text_tokens": 1, "audio_tokens": 2}
