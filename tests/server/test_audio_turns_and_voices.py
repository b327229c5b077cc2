"""Multi-turn audio (an earlier spoken answer given back by its audio id) and voices by OpenAI's names, through
the clients that use them: LangChain's ChatOpenAI for the two-turn conversation, the openai SDK for the rest.

In-process over test_speech_api's speaking fake pipeline, whose prompt is its messages' contents, one a line.
"""

from __future__ import annotations

import typing

import openai
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from openai.types.audio.speech_create_params import Voice
from test_speech_api import MODEL, SpeakingPipeline

from omnistage.errors import ConfigError
from omnistage.server import build_app
from omnistage.server.spoken_answers import SpokenAnswers
from omnistage.server.voices import DEFAULT_ALIASES


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine() -> SpeakingPipeline:
    return SpeakingPipeline()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def http(engine, clock) -> TestClient:
    return TestClient(build_app(engine, MODEL, answers=SpokenAnswers(retention_s=60, clock=clock)))


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def prompt_of(engine: SpeakingPipeline) -> str:
    return "".join(map(chr, engine.calls[-1][0]))


def spoken_chat(client: openai.OpenAI, messages: list, voice: str = "alloy", **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"},
        max_tokens=5,
        **kwargs,
    )


# -- multi-turn audio -----------------------------------------------------------------------------------


def test_langchain_two_turn_audio_conversation(http, engine, clock):
    llm = ChatOpenAI(
        model=MODEL,
        base_url="http://testserver/v1",
        api_key="none",
        http_client=http,
        max_retries=0,
        max_tokens=5,
        model_kwargs={"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
    )
    first = llm.invoke([HumanMessage("Say hello")])
    audio = first.additional_kwargs["audio"]
    assert audio["transcript"] == "Say h" and audio["expires_at"] == int(clock.now) + 60
    second = llm.invoke([HumanMessage("Say hello"), first, HumanMessage("Again")])
    # LangChain sent the first answer back as {"audio": {"id": ...}}: the Thinker read its transcript
    assert prompt_of(engine) == "Say hello\nSay h\nAgain"
    assert second.additional_kwargs["audio"]["id"] != audio["id"]


def test_an_expired_or_unknown_audio_id_is_400_naming_it(client, engine, clock):
    first = spoken_chat(client, [{"role": "user", "content": "Hi there"}])
    answer = {"role": "assistant", "content": None, "audio": {"id": first.choices[0].message.audio.id}}
    turns = [{"role": "user", "content": "Hi there"}, answer, {"role": "user", "content": "More"}]
    client.chat.completions.create(model=MODEL, messages=turns, max_tokens=2)  # a text reply may follow it
    assert prompt_of(engine) == "Hi there\nHi th\nMore"
    clock.now += 60
    with pytest.raises(openai.BadRequestError) as expired:
        client.chat.completions.create(model=MODEL, messages=turns, max_tokens=2)
    assert expired.value.body["param"] == "messages[1].audio.id"
    assert "it is unknown, or it expired (answers are kept 60 s" in expired.value.body["message"]
    turns[1] = {"role": "assistant", "audio": {"id": "audio-nobody"}}
    with pytest.raises(openai.BadRequestError, match="no spoken answer 'audio-nobody' is kept"):
        client.chat.completions.create(model=MODEL, messages=turns, max_tokens=2)


def test_a_streamed_answer_is_kept_with_the_expiry_it_streamed(client, engine, clock):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream it"}],
        modalities=["text", "audio"],
        audio={"voice": "ash", "format": "pcm16"},
        max_tokens=6,
        stream=True,
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    audio = [delta.audio for delta in deltas if delta.audio is not None]
    audio_id, expires_at = audio[0].id, audio[-1].expires_at
    assert expires_at == int(clock.now) + 60
    turns = [
        {"role": "assistant", "content": "", "audio": {"id": audio_id}},
        {"role": "user", "content": "Go"},
    ]
    client.chat.completions.create(model=MODEL, messages=turns, max_tokens=2)
    assert prompt_of(engine) == "Stream\nGo"


# -- voices by OpenAI's names ---------------------------------------------------------------------------


def test_the_default_table_names_every_openai_voice():
    literal = next(a for a in typing.get_args(Voice) if typing.get_origin(a) is typing.Literal)
    assert sorted(typing.get_args(literal)) == sorted(DEFAULT_ALIASES)


@pytest.mark.parametrize(("voice", "speaker"), [("alloy", "ethan"), ("ash", "ethan"), ("Coral", "chelsie")])
def test_openai_voice_names_speak_as_their_speakers(client, engine, voice, speaker):
    client.audio.speech.create(model=MODEL, input="Hi", voice=voice, response_format="wav")
    assert engine.calls[-1][2].voice == speaker
    spoken_chat(client, [{"role": "user", "content": "Hi"}], voice=voice)
    assert engine.calls[-1][2].voice == speaker


def test_voices_lists_the_speakers_and_their_aliases(http):
    listing = http.get("/v1/audio/voices").json()
    assert listing["voices"] == ["aiden", "chelsie", "ethan"]
    assert listing["aliases"] == dict(sorted(DEFAULT_ALIASES.items()))


def test_configured_aliases_override_the_table(engine):
    http = TestClient(build_app(engine, MODEL, voice_aliases={"alloy": "chelsie", "narrator": "Aiden"}))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    client.audio.speech.create(model=MODEL, input="Hi", voice="alloy", response_format="wav")
    assert engine.calls[-1][2].voice == "chelsie"
    spoken_chat(client, [{"role": "user", "content": "Hi"}], voice="narrator")
    assert engine.calls[-1][2].voice == "aiden"
    assert http.get("/v1/audio/voices").json()["aliases"]["narrator"] == "aiden"


@pytest.mark.parametrize(
    ("aliases", "needle"),
    [
        (
            {"alloy": "serena"},
            "'serena' is not a speaker of this checkpoint; it speaks as aiden, chelsie, ethan",
        ),
        ({"ethan": "chelsie"}, "'ethan' is a speaker's own name"),
    ],
)
def test_an_alias_of_no_speaker_stops_the_start(engine, aliases, needle):
    with pytest.raises(ConfigError, match=needle):
        build_app(engine, MODEL, voice_aliases=aliases)


def test_an_unknown_voice_names_the_aliases_too(http):
    r = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
    assert "speaks with aiden, chelsie, ethan and the aliases alloy, ash," in r.json()["error"]["message"]


def test_the_voices_of_a_checkpoint_that_cannot_speak_are_none():
    http = TestClient(build_app(SpeakingPipeline(voices=()), MODEL))
    assert http.get("/v1/audio/voices").json() == {"voices": [], "aliases": {}}
    r = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "alloy"})
    assert r.status_code == 400 and "it has no talker" in r.json()["error"]["message"]


def test_voices_is_behind_the_api_key(engine):
    http = TestClient(build_app(engine, MODEL, api_key="k"))
    assert http.get("/v1/audio/voices").status_code == 401
    assert http.get("/v1/audio/voices", headers={"Authorization": "Bearer k"}).status_code == 200
