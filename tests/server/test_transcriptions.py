"""/v1/audio/transcriptions and /v1/audio/translations in-process on the fake engine (which echoes its prompt),
through the openai client."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from omnistage.models.qwen3_omni.transcription import language_name, transcription_messages
from omnistage.server import build_app

MODEL = "fake-model"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
ECHO = "<audio 2.98s>Transcribe the audio into text."


@pytest.fixture
def http(fake_pipeline) -> TestClient:
    return TestClient(build_app(fake_pipeline, MODEL))


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_json_is_the_default(client):
    result = client.audio.transcriptions.create(file=SPEECH.open("rb"), model=MODEL)
    assert result.text == ECHO


def test_language_and_prompt_shape_the_instruction(client):
    result = client.audio.transcriptions.create(
        file=SPEECH.open("rb"),
        model=MODEL,
        language="en",
        prompt="Names: Ada, Grace.",
        extra_body={"max_tokens": 100},  # the echo is longer than the 2.98 s clip's cap of 80 tokens
    )
    assert result.text == f"Names: Ada, Grace.\n{ECHO} The language is English."


def test_text_format(client):
    assert (
        client.audio.transcriptions.create(file=SPEECH.open("rb"), model=MODEL, response_format="text")
        == ECHO
    )


def test_verbose_json(client):
    result = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=MODEL, response_format="verbose_json", language="de"
    )
    assert (result.task, result.language, result.duration) == ("transcribe", "german", 2.98)
    assert result.text == f"{ECHO} The language is German." and result.segments == []


def test_forced_length_extras_and_stream(client):
    stream = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=MODEL, stream=True, extra_body={"max_tokens": 7, "min_tokens": 7}
    )
    events = list(stream)
    assert [e.type for e in events] == ["transcript.text.delta"] * 7 + ["transcript.text.done"]
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == ECHO[:7]
    assert events[-1].usage.output_tokens == 7


def test_srt_and_vtt_time_the_transcript_over_the_clip(client):
    text = f"{ECHO} The language is English."  # two sentences: two cues sharing the 2.98 s
    srt = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=MODEL, response_format="srt", language="en"
    )
    first, second = len(ECHO), len(" The language is English.") - 1
    split = round(2.98 * first / (first + second), 3)
    clock = f"00:00:{int(split):02d},{round(split % 1 * 1000):03d}"
    assert srt == (
        f"1\n00:00:00,000 --> {clock}\n{ECHO}\n\n2\n{clock} --> 00:00:02,980\nThe language is English.\n\n"
    )
    vtt = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=MODEL, response_format="vtt", language="en"
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.endswith(
        " --> 00:00:02.980\nThe language is English.\n\n"
    )
    cue_lines = [line for line in vtt.splitlines()[2:] if line and "-->" not in line]
    assert " ".join(cue_lines) == text


def test_translations_tell_the_thinker_to_translate(client):
    result = client.audio.translations.create(file=SPEECH.open("rb"), model=MODEL, prompt="Context.")
    assert result.text.startswith("Context.\n<audio 2.98s>Translate the speech in the audio into English")
    verbose = client.audio.translations.create(
        file=SPEECH.open("rb"), model=MODEL, response_format="verbose_json"
    )
    assert (verbose.task, verbose.language, verbose.duration) == ("translate", "english", 2.98)
    with pytest.raises(openai.BadRequestError, match="response_format: 'mp3' is not supported"):
        client.audio.translations.create(file=SPEECH.open("rb"), model=MODEL, response_format="mp3")


@pytest.mark.parametrize("fmt", ["diarized_json", "csv"])
def test_other_formats_are_400(client, fmt):
    with pytest.raises(
        openai.BadRequestError, match=f"response_format: '{fmt}' is not supported; use one of json"
    ):
        client.audio.transcriptions.create(file=SPEECH.open("rb"), model=MODEL, response_format=fmt)


def test_bad_audio_is_400(client):
    with pytest.raises(openai.BadRequestError, match="file: audio could not be decoded"):
        client.audio.transcriptions.create(file=("x.wav", b"RIFF....WAVEjunk"), model=MODEL)
    with pytest.raises(openai.BadRequestError, match=r"file: audio is empty \(0 bytes\)"):
        client.audio.transcriptions.create(file=("x.wav", b""), model=MODEL)


def test_missing_file_and_unknown_model(http, client):
    r = http.post("/v1/audio/transcriptions", data={"model": MODEL})
    assert r.status_code == 400 and "file: Field required" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="'whisper-1' does not exist"):
        client.audio.transcriptions.create(file=SPEECH.open("rb"), model="whisper-1")


def test_transcription_messages():
    audio = np.zeros(16000, dtype=np.float32)
    (user,) = transcription_messages(audio, None, None)
    assert user["role"] == "user" and user["content"][0]["audio"] is audio
    assert user["content"][1] == {"type": "text", "text": "Transcribe the audio into text."}
    system, user = transcription_messages(audio, "Cantonese", "context")
    assert system == {"role": "system", "content": "context"}
    assert user["content"][1]["text"].endswith("The language is Cantonese.")
    assert language_name("ZH") == "Chinese" and language_name("xx") == "xx" and language_name("") is None
