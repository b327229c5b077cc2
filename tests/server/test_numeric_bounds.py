"""Every numeric field is bounded at the edge: huge integers and NaN/inf are a 400 naming the field, never a
500 from the sampler (which would fail the whole batch), over the real tiny engine in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from omnistage.errors import InvalidRequest
from omnistage.request import SamplingParams
from omnistage.server import build_app

MODEL = "tiny"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
HUGE = 2**64
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(tiny_pipeline) -> TestClient:
    return TestClient(build_app(tiny_pipeline, MODEL))


def post(client: TestClient, path: str, body: dict):
    # json.dumps writes NaN and Infinity as Python's json module reads them (as the server does).
    content = json.dumps({"model": MODEL} | body)
    return client.post(path, content=content, headers={"content-type": "application/json"})


def assert_400(response, param: str, needle: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert needle in error["message"]


INTEGERS = ["top_k", "seed", "max_tokens", "max_completion_tokens", "min_tokens", "n", "top_logprobs"]
FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("field", INTEGERS)
@pytest.mark.parametrize("value", [HUGE, -HUGE, 10**400], ids=["2**64", "-2**64", "10**400"])
def test_chat_integers_beyond_int64_are_400(client, field, value):
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 1.0} | {field: value}
    r = post(client, "/v1/chat/completions", body)
    assert_400(r, field)
    assert len(r.json()["error"]["message"]) < 300  # a 400-digit number is not echoed whole


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), 10**400], ids=["nan", "inf", "-inf", "10**400"]
)
def test_chat_floats_must_be_finite(client, field, value):
    body = {"messages": MESSAGES, "max_tokens": 2} | {field: value}
    assert_400(post(client, "/v1/chat/completions", body), field)


def test_list_items_name_their_index(client):
    body = {"messages": MESSAGES, "stop_token_ids": [1, HUGE]}
    assert_400(post(client, "/v1/chat/completions", body), "stop_token_ids[1]")
    assert_400(post(client, "/v1/completions", {"prompt": [1, 2, HUGE]}), "prompt[2]")
    assert_400(post(client, "/v1/completions", {"prompt": [[1, -HUGE]]}), "prompt[0][1]")
    assert_400(post(client, "/v1/completions", {"prompt": "x", "max_tokens": HUGE}), "max_tokens")


def test_largest_int64_top_k_samples(client):
    body = {"messages": MESSAGES, "top_k": 2**63 - 1, "seed": 2**63 - 1, "temperature": 1.0, "max_tokens": 2}
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "nan"),
        ("temperature", "inf"),
        ("temperature", "1e999"),
        ("max_tokens", str(HUGE)),
        ("min_tokens", str(-HUGE)),
        ("seed", str(10**30)),
    ],
    ids=["nan", "inf", "1e999", "max_tokens", "min_tokens", "seed"],
)
def test_transcription_form_numbers_are_bounded(client, field, value):
    r = client.post(
        "/v1/audio/transcriptions",
        data={"model": MODEL, "max_tokens": "2", field: value},
        files={"file": ("speech.wav", SPEECH.read_bytes(), "audio/wav")},
    )
    assert_400(r, field)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": HUGE},
        {"seed": HUGE},
        {"max_tokens": HUGE},
        {"min_tokens": -1},
        {"stop_token_ids": [HUGE]},
        {"temperature": 10**400},
        {"top_p": float("nan")},
        {"repetition_penalty": 10**400},
        {"presence_penalty": float("nan")},
        {"n": True},
    ],
)
def test_offline_sampling_params_refuse_what_the_sampler_cannot_take(kwargs):
    with pytest.raises(InvalidRequest, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
