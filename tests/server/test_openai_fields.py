"""Every field of OpenAI's chat, completions and transcription requests is honoured, ignored where that is
harmless, or refused where ignoring it would change what the client gets; loosely typed values are 400s,
as OpenAI answers them. In-process on the fake engine (which echoes its prompt)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from omnistage.server import build_app
from omnistage.server.protocol.chat import ChatCompletionRequest

MODEL = "fake-model"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def http(fake_pipeline) -> TestClient:
    return TestClient(build_app(fake_pipeline, MODEL))


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def chat(http: TestClient, **fields):
    return http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5} | fields
    )


def assert_400(response, needle: str, param: str | None = None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"], error
    if param is not None:
        assert error["param"] == param, error


# Fields that change nothing the client receives from this server: accepted and ignored.
IGNORED_CHAT = {
    "store": True,
    "metadata": {"team": "search"},
    "modalities": ["text"],
    "service_tier": "auto",
    "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "hello"},
    "user": "user-1",
    "safety_identifier": "hash-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "verbosity": "low",
    "parallel_tool_calls": False,
    "tool_choice": "none",
    "function_call": "none",
    "tools": [],
    "logprobs": False,
    "top_logprobs": 0,
    "response_format": {"type": "text"},
    "logit_bias": {},
    "n": 1,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
}


@pytest.mark.parametrize("field", IGNORED_CHAT)
def test_harmless_chat_fields_are_accepted(http, field):
    r = chat(http, **{field: IGNORED_CHAT[field]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello"


def test_the_openai_client_with_every_harmless_field(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "be brief"}, *MESSAGES],
        max_completion_tokens=5,
        stream=True,
        **IGNORED_CHAT,
    )
    chunks = list(reply)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "be br"
    assert chunks[-1].usage.completion_tokens == 5


REFUSED_CHAT = [
    ({"n": 17}, "n must be between 1 and 16"),
    ({"top_logprobs": 3}, "needs logprobs set to true"),
    ({"top_logprobs": 21}, "less than or equal to 20"),
    ({"functions": [{"name": "f"}]}, "legacy form: send tools and tool_choice"),
    ({"tool_choice": "required"}, "requires tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "requires tools"),
    (
        {
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "names 'g', which is not among the request's tools",
    ),
    ({"function_call": {"name": "f"}}, "legacy form: send tools and tool_choice"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "the constraint cannot be compiled",
    ),
    ({"modalities": ["text", "audio"]}, "audio output is not supported"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio output is not supported"),
    ({"web_search_options": {}}, "web search is not supported"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation is not supported"),
    ({"logit_bias": {"x": -100}}, "keys must be token ids"),
    ({"logit_bias": {"5": -101}}, "must be in [-100, 100]"),
]


@pytest.mark.parametrize(("fields", "needle"), REFUSED_CHAT)
def test_fields_whose_meaning_would_be_lost_are_400(http, fields, needle):
    assert_400(chat(http, **fields), needle, param=next(iter(fields)))


@pytest.mark.parametrize(
    ("message", "needle", "param"),
    [
        (
            {"role": "tool", "content": "42"},
            "a tool message names the call it answers",
            "messages[1]",
        ),
        (
            {"role": "function", "content": "42", "name": "f"},
            "the legacy function calling is not supported",
            "messages[1]",
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            "Field required",
            "messages[1].tool_calls[0].function",
        ),
        (
            {"role": "assistant", "audio": {"id": "audio-1"}},
            "no spoken answer 'audio-1' is kept",
            "messages[1].audio.id",
        ),
        ({"role": "user"}, "content is missing", "messages[1]"),
        ({"role": "robot", "content": "x"}, "Input should be", "messages[1].role"),
    ],
)
def test_messages_of_unsupported_roles_are_400(http, message, needle, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [*MESSAGES, message]})
    assert_400(r, needle, param)


def test_assistant_refusal_and_names_are_accepted(http):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}], "name": "rules"},
        {"role": "user", "content": "hi", "name": "ada"},
        {"role": "assistant", "content": "no", "refusal": None, "name": "bot"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "again", "prompt_cache_breakpoint": {"mode": "explicit"}}],
        },
    ]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_developer_messages_are_system_messages():
    request = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}]
    )
    assert [m["role"] for m in request.message_dicts()] == ["system", "user"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": True}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": True}, "max_tokens"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"n": "1"}, "n"),
        ({"top_p": "0.5"}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
        ),
        ({"store": "true"}, "store"),
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
def test_loosely_typed_values_are_400(http, fields, param):
    assert_400(chat(http, **fields), "", param)


def test_integers_are_numbers_for_float_fields(http):
    assert chat(http, temperature=1, top_p=1, presence_penalty=0).status_code == 200


def test_completions_fields(http):
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 5,
        "best_of": 1,
        "echo": False,
        "suffix": "",
        "user": "u",
        "logit_bias": {},
        "seed": 3,
        "stream_options": {"include_usage": True, "include_obfuscation": True},
        "store": False,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello"
    echoed = http.post("/v1/completions", json=body | {"echo": True, "max_tokens": 3})
    assert echoed.json()["choices"][0]["text"] == "hello" + "hel"
    assert_400(
        http.post("/v1/completions", json=body | {"echo": True, "logprobs": 2}), "prompt's logprobs", "echo"
    )
    assert_400(
        http.post("/v1/completions", json=body | {"logprobs": 6}), "less than or equal to 5", "logprobs"
    )
    assert_400(http.post("/v1/completions", json=body | {"best_of": 17}), "between 1 and 16", "best_of")
    assert_400(http.post("/v1/completions", json=body | {"suffix": "x"}), "suffix is not supported", "suffix")
    assert_400(http.post("/v1/completions", json=body | {"echo": "no"}), "", "echo")


def test_transcription_fields(http, fake_pipeline):
    def post(**fields):
        data = {"model": MODEL, "max_tokens": "4"} | fields
        return http.post(
            "/v1/audio/transcriptions", data=data, files={"file": ("a.wav", SPEECH.read_bytes())}
        )

    accepted = {
        "chunking_strategy": "auto",
        "known_speaker_names[]": ["ada"],
        "known_speaker_references[]": ["data:audio/wav;base64,AAAA"],
        "keywords[]": ["Ada"],
        "languages[]": ["en"],
        "timestamp_granularities[]": [],
    }
    r = post(**accepted)
    assert r.status_code == 200, r.text
    assert_400(post(**{"timestamp_granularities[]": ["word"]}), "timestamps are not supported")
    assert_400(post(**{"include[]": ["logprobs"], "response_format": "text"}), "json only", "include[]")
    assert_400(post(**{"include[]": ["words"]}), "'words' is not supported", "include[]")
