"""The response fields the SDK's types have beside the answer: system_fingerprint, usage's prompt details, the
x-request-id header, and `param` naming the field of every 400 about one. In-process over test_speech_api's
speaking fake pipeline, through the openai SDK."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from test_speech_api import MODEL, SpeakingPipeline

from omnistage.server import build_app

MESSAGES = [{"role": "user", "content": "Hello"}]
SPOKEN = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


@pytest.fixture
def http() -> TestClient:
    return TestClient(build_app(SpeakingPipeline(), MODEL))


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_system_fingerprint_is_stable_and_in_every_chunk(client, http):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert first.system_fingerprint and first.system_fingerprint == second.system_fingerprint
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
    assert {chunk.system_fingerprint for chunk in stream} == {first.system_fingerprint}
    other = TestClient(build_app(SpeakingPipeline(), "another-name"))
    body = {"model": "another-name", "messages": MESSAGES, "max_tokens": 1}
    assert (
        other.post("/v1/chat/completions", json=body).json()["system_fingerprint"] != first.system_fingerprint
    )


def test_usage_has_the_prompts_details(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert reply.usage.prompt_tokens_details.audio_tokens == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    [usage] = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_x_request_id_echoes_the_clients_else_names_the_response(client, http):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert raw.headers["x-request-id"] == raw.parse().id
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42"
    speech = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "ethan"})
    assert speech.headers["x-request-id"].startswith("speech-")
    refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert refused.status_code == 400 and refused.headers["x-request-id"].startswith("req-")
    assert (
        http.get("/health", headers={"x-request-id": "bad id\x01"}).headers["x-request-id"].startswith("req-")
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 0} | SPOKEN, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav", "top_p": 0}},
            "audio.top_p",
        ),
    ],
)
def test_a_sampling_field_out_of_range_is_named(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=fields)
    assert refused.value.body["param"] == param, refused.value.body


@pytest.mark.parametrize(
    ("prompt", "param"), [("", "prompt"), (["a", ""], "prompt[1]"), ([[5], []], "prompt[1]")]
)
def test_a_completions_prompt_error_names_the_prompt(http, prompt, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and "must not be empty" in r.text
