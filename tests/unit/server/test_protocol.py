"""The speech parts of the HTTP protocol: request fields and their bounds, and usage and message shapes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omnistage.errors import InvalidRequest
from omnistage.server.protocol.chat import ChatCompletionRequest
from omnistage.server.protocol.speech import MAX_SPEECH_INPUT, ChatAudioParams, SpeechRequest, VoiceRef
from omnistage.server.responses import AssistantMessage, Usage

SPEECH = {"model": "tiny", "input": "Hello there.", "voice": "ethan"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def errors(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[tuple, str]]:
    return [(e["loc"], e["msg"]) for e in exc.value.errors()]


def test_speech_request_defaults_follow_openai():
    body = SpeechRequest(**SPEECH)
    assert (body.response_format, body.stream_format, body.voice) == ("mp3", "audio", "ethan")
    assert SpeechRequest(**SPEECH | {"voice": {"id": "chelsie"}}).voice == VoiceRef(id="chelsie")
    assert SpeechRequest(**SPEECH | {"speed": 1.0, "instructions": "", "user": "u"}).speed == 1.0


def test_speech_takes_openais_speeds_and_instructions():
    for speed in (0.25, 1.5, 4.0):
        assert SpeechRequest(**SPEECH | {"speed": speed}).speed == speed
    assert SpeechRequest(**SPEECH | {"instructions": "whisper"}).instructions == "whisper"


@pytest.mark.parametrize(
    ("fields", "loc", "needle"),
    [
        ({"input": ""}, ("input",), "at least 1 character"),
        ({"input": "a" * (MAX_SPEECH_INPUT + 1)}, ("input",), f"at most {MAX_SPEECH_INPUT} characters"),
        ({"speed": 0.2}, ("speed",), "greater than or equal to 0.25"),
        ({"speed": 4.5}, ("speed",), "less than or equal to 4"),
        ({"speed": float("nan")}, ("speed",), "finite number"),
        ({"stream_format": "chunks"}, ("stream_format",), "'audio' or 'sse'"),
        ({"max_frames": 0}, ("max_frames",), "greater than or equal to 1"),
        ({"max_frames": 2**63}, ("max_frames",), "less than or equal to"),
        ({"seed": -(2**63) - 1}, ("seed",), "greater than or equal to"),
        ({"temperature": float("nan")}, ("temperature",), "finite number"),
        ({"voice": 3}, ("voice",), "a voice's name or an object naming it"),
        ({"max_frames": 4097}, ("max_frames",), "less than or equal to 4096"),
        ({"min_frames": 4097}, ("min_frames",), "less than or equal to 4096"),
        ({"response_format": 1}, ("response_format",), "valid string"),
        ({"stream": True}, ("stream",), "Extra inputs are not permitted"),
    ],
)
def test_speech_request_fields_are_bounded(fields, loc, needle):
    with pytest.raises(ValidationError) as exc:
        SpeechRequest(**SPEECH | fields)
    found = errors(exc)
    assert any(where[: len(loc)] == loc and needle in msg for where, msg in found), found


def test_the_talker_takes_the_released_defaults_under_the_request_overrides():
    params = SpeechRequest(**SPEECH).talker_params(seed=None)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.9,
        50,
        1.05,
        None,
    )
    given = SpeechRequest(**SPEECH | {"max_frames": 25, "temperature": 0.0, "top_k": 5, "top_p": 0.8})
    params = given.talker_params(seed=7)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.seed) == (
        25,
        0.0,
        5,
        0.8,
        7,
    )
    assert params.repetition_penalty == 1.05
    with pytest.raises(InvalidRequest, match="top_p must be in"):
        SpeechRequest(**SPEECH | {"top_p": 0.0}).talker_params(seed=None)


def test_chat_audio_is_voice_and_format_plus_the_talker_controls():
    body = ChatCompletionRequest(
        **CHAT, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav", "max_frames": 4}
    )
    assert body.asks_for_audio() and body.audio == ChatAudioParams(voice="ethan", format="wav", max_frames=4)
    assert ChatCompletionRequest(**CHAT, audio={"voice": "ethan", "format": "wav"}).asks_for_audio()
    assert not ChatCompletionRequest(**CHAT, modalities=["text"]).asks_for_audio()
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest(**CHAT, audio={"voice": "ethan"})
    assert errors(exc) == [(("audio", "format"), "Field required")]
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest(**CHAT, audio={"voice": "ethan", "format": "wav", "speed": 2})
    assert errors(exc) == [(("audio", "speed"), "Extra inputs are not permitted")]
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest(**CHAT, modalities=["text", "video"])
    assert errors(exc)[0][0] == ("modalities", 1)


def test_an_earlier_audio_answer_is_its_transcript_in_the_template():
    messages = [
        *CHAT["messages"],
        {"role": "assistant", "content": "", "audio": {"id": "audio-1"}},
        {"role": "user", "content": "And?"},
    ]
    body = ChatCompletionRequest(model="tiny", messages=messages)
    assert body.message_dicts({1: "Hello there"})[1] == {"role": "assistant", "content": "Hello there"}


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        ({"role": "user", "audio": {"id": "audio-1"}}, "only an assistant message refers"),
        ({"role": "assistant", "content": "Hi", "audio": {"id": "audio-1"}}, "not both"),
        ({"role": "assistant", "audio": {}}, "Field required"),
        ({"role": "assistant", "audio": {"id": "a", "data": "x"}}, "Extra inputs"),
    ],
)
def test_an_earlier_audio_answer_is_named_by_its_id_alone(message, needle):
    with pytest.raises(ValidationError, match=needle):
        ChatCompletionRequest(model="tiny", messages=[*CHAT["messages"], message])


def test_usage_and_message_read_as_before_unless_the_reply_spoke():
    assert Usage.of(3, 4).model_dump() == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert Usage.of(3, 4, audio_tokens=10).model_dump() == {
        "prompt_tokens": 3,
        "completion_tokens": 14,
        "total_tokens": 17,
        "completion_tokens_details": {"text_tokens": 4, "audio_tokens": 10},
    }
    assert AssistantMessage(content="Hi").model_dump() == {"role": "assistant", "content": "Hi"}


def test_forced_frame_counts_for_benchmarks():
    params = SpeechRequest(**SPEECH | {"max_frames": 9, "min_frames": 9, "ignore_eos": True}).talker_params(
        None
    )
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (9, 9, True)
    with pytest.raises(InvalidRequest, match=r"min_frames \(10\) must not exceed max_frames \(9\)"):
        SpeechRequest(**SPEECH | {"max_frames": 9, "min_frames": 10}).talker_params(None)
