"""The app's error mapping and stream framing, in-process on a fake pipeline (failures a real model cannot show)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from omnistage.server import build_app

MODEL = "fake-model"


@pytest.fixture
def client(fake_pipeline) -> TestClient:
    return TestClient(build_app(fake_pipeline, MODEL, api_key="k", max_body_bytes=4096))


AUTH = {"Authorization": "Bearer k"}


def chat(client: TestClient, content: str, **extra) -> object:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8} | extra
    return client.post("/v1/chat/completions", json=body, headers=AUTH)


def events(response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def assert_error(response, status: int, type_: str, message: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert message in error["message"]
    return error


def test_chat_echo_and_usage(client, fake_pipeline):
    r = chat(client, "hello world", max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hello"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 5,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    }
    assert fake_pipeline.running == set()


def test_engine_exception_fails_only_that_request(client, fake_pipeline):
    assert_error(
        chat(client, "explode"), 500, "server_error", "the engine failed this request: CUDA out of memory"
    )
    assert chat(client, "fine").json()["choices"][0]["message"]["content"] == "fine"


def test_engine_error_output_is_500_and_next_works(client, fake_pipeline):
    error = assert_error(chat(client, "fail now"), 500, "server_error", "OutOfMemoryError: pretend")
    assert error["code"] == "engine_error"
    assert chat(client, "fine").status_code == 200
    metrics = client.get("/metrics").text
    assert 'omnistage_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0' in metrics
    assert 'omnistage_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics


def test_the_prepare_phase_runs_from_the_whole_body_to_the_hand_over(client, fake_pipeline, monkeypatch):
    """/metrics' prepare phase: from the moment the body is in (the gate) to the engine's generate, so the
    prompt's layout counts; a request refused before the hand-over is not counted. Its parse part ends where
    the handler starts: every parsed request counts, and the prompt's layout is not in it."""
    processor = fake_pipeline.frontend.processor
    encode_chat = processor.encode_chat
    SLOW_S = 0.3  # the layout's time, well above what parsing or a first chunk take on a loaded machine

    def slow_encode_chat(*args, **kwargs):
        time.sleep(SLOW_S)
        return encode_chat(*args, **kwargs)

    monkeypatch.setattr(processor, "encode_chat", slow_encode_chat)
    assert chat(client, "hello", stream=True).status_code == 200
    assert chat(client, "hello", model="another").status_code == 404
    metrics = client.get("/metrics").text
    samples = dict(
        line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("omnistage_request_phase")
    )
    assert float(samples['omnistage_request_phase_seconds_count{phase="prepare"}']) == 1
    assert SLOW_S <= float(samples['omnistage_request_phase_seconds_sum{phase="prepare"}']) < 5
    assert float(samples['omnistage_request_phase_seconds_count{phase="parse"}']) == 2
    assert 0 < float(samples['omnistage_request_phase_seconds_sum{phase="parse"}']) < SLOW_S
    assert float(samples['omnistage_request_phase_seconds_count{phase="receive"}']) == 2
    # the stream's first output in its handler to its first chunk written: once, and short
    assert float(samples['omnistage_request_phase_seconds_count{phase="respond"}']) == 1
    assert 0 < float(samples['omnistage_request_phase_seconds_sum{phase="respond"}']) < SLOW_S


def test_a_request_counts_as_being_prepared_from_its_body_to_its_hand_over(
    client, fake_pipeline, monkeypatch
):
    """The engine's count of requests being prepared (what an idle engine waits for: step_loop.py) holds a
    generating request from the gate to the hand-over, excluding itself when it is handed over; a request
    refused in its preparation, or one to a path that generates nothing, leaves it at 0."""
    processor = fake_pipeline.frontend.processor
    encode_chat = processor.encode_chat
    during = []

    def observed_encode_chat(*args, **kwargs):
        during.append(fake_pipeline.in_preparation)
        return encode_chat(*args, **kwargs)

    monkeypatch.setattr(processor, "encode_chat", observed_encode_chat)
    assert chat(client, "hello", stream=True).status_code == 200
    assert during == [1] and fake_pipeline.coming_at_generate == [0]
    assert chat(client, "hello", model="another").status_code == 404
    assert chat(client, "boom").status_code == 500  # the processor raised
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert fake_pipeline.in_preparation == 0 and fake_pipeline.coming_at_generate == [0]


def test_queue_full_is_503(client):
    error = assert_error(chat(client, "queue-full"), 503, "server_overloaded", "queue is full")
    assert error["code"] == "queue_full"


def test_stream_failing_before_first_output_keeps_its_status(client):
    assert_error(chat(client, "explode", stream=True), 500, "server_error", "CUDA out of memory")
    assert_error(chat(client, "queue-full", stream=True), 503, "server_overloaded", "queue is full")


def test_stream_failing_midway_sends_an_error_event(client, fake_pipeline):
    r = chat(client, "crash here", stream=True)
    assert r.status_code == 200
    sent = events(r)
    assert sent[-1] == "[DONE]"
    error = json.loads(sent[-2])["error"]
    assert error["message"] == "the engine failed this request: internal engine error"
    assert error["type"] == "server_error"
    assert fake_pipeline.running == set()
    assert chat(client, "fine", stream=True).status_code == 200


def test_stream_framing_chat(client):
    r = chat(client, "abc", stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    sent = events(r)
    assert sent[-1] == "[DONE]"
    chunks = [json.loads(e) for e in sent[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == "abc"
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "chat.completion.chunk"


def test_stream_framing_completions_without_usage(client):
    body = {"model": MODEL, "prompt": "xyz", "max_tokens": 3, "stream": True}
    sent = events(client.post("/v1/completions", json=body, headers=AUTH))
    chunks = [json.loads(e) for e in sent[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["x", "y", "z"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"temperature": "hot"}, "temperature: Input should be a valid number", "temperature"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role: Input should be",
            "messages[0].role",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]},
            "messages[0].content[0].type: content parts of type 'file' are not supported; use one of text, "
            "input_audio, audio_url, image_url, video_url",
            "messages[0].content[0].type",
        ),
        ({"max_tokenz": 3}, "max_tokenz: unknown field", "max_tokenz"),
        ({"messages": []}, "messages: List should have at least 1 item", "messages"),
        (
            {"stream_options": {"include_usage": "maybe"}},
            "stream_options.include_usage:",
            "stream_options.include_usage",
        ),
    ],
)
def test_invalid_body_names_the_field(client, body, message, param):
    full = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]} | body
    error = assert_error(
        client.post("/v1/chat/completions", json=full, headers=AUTH), 400, "invalid_request_error", message
    )
    assert error["param"] == param


def test_invalid_json_and_missing_body(client):
    r = client.post(
        "/v1/chat/completions", content=b"{nope", headers=AUTH | {"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request_error", "the body is not valid JSON")
    assert_error(
        client.post("/v1/completions", headers=AUTH), 400, "invalid_request_error", "body is missing"
    )


def test_sampling_rules_are_400(client):
    assert_error(chat(client, "x", n=17), 400, "invalid_request_error", "n must be between 1 and 16")
    assert_error(chat(client, "x", top_p=0), 400, "invalid_request_error", "top_p must be in (0, 1]")
    assert_error(
        chat(client, "x", top_logprobs=2), 400, "invalid_request_error", "needs logprobs set to true"
    )
    body = {"model": MODEL, "prompt": ["a", ""]}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert_error(r, 400, "invalid_request_error", "prompt[1]: must not be empty")


def test_api_key_guards_v1_only(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert_error(client.post("/v1/chat/completions", json=body), 401, "authentication_error", "API key")
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, "authentication_error", "API key")
    assert_error(client.get("/v1/models"), 401, "authentication_error", "API key")
    # A bad key is refused before the body is even parsed.
    assert_error(client.post("/v1/completions", content=b"{nope"), 401, "authentication_error", "API key")
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_unknown_model_is_404(client):
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
    error = assert_error(
        client.post("/v1/chat/completions", json=body, headers=AUTH),
        404,
        "invalid_request_error",
        "'gpt-4o' does not exist",
    )
    assert error["code"] == "model_not_found"
    assert client.get(f"/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL
    assert_error(
        client.get("/v1/models/gpt-4o", headers=AUTH), 404, "invalid_request_error", "does not exist"
    )


def test_body_over_the_limit_is_413(client):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = client.post("/v1/chat/completions", json=big, headers=AUTH)
    assert_error(r, 413, "invalid_request_error", "the limit is 4,096 bytes")

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b"x" * 1000

    r = client.post("/v1/chat/completions", content=chunked(), headers=AUTH)
    assert_error(r, 413, "invalid_request_error", "the limit is 4,096 bytes")


def test_health_follows_engine_readiness(client, fake_pipeline):
    assert client.get("/health").json() == {"status": "ok"}
    fake_pipeline.ready = False
    assert client.get("/health").status_code == 503


def test_ten_thousand_bad_fields_are_answered_at_once(fake_pipeline):
    client = TestClient(build_app(fake_pipeline, MODEL))
    fields = {f"x{i}": i for i in range(10_000)}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}
    started = time.monotonic()
    r = client.post("/v1/chat/completions", json=body)
    assert time.monotonic() - started < 2  # the paths are compared in linear time, not pairwise
    error = assert_error(r, 400, "invalid_request_error", "x0: unknown field; x1: unknown field")
    assert error["message"].endswith("and 9997 more") and error["param"] == "x0"


def test_metrics_carry_the_memory_plan(fake_pipeline):
    from omnistage.engine.memory.gauges import plan_gauges
    from omnistage.engine.memory.plan import (
        DeviceMemory,
        GiB,
        GraphCandidates,
        KVPool,
        StageMemory,
    )
    from omnistage.engine.memory.planner import plan_device

    stage = StageMemory(
        resident=(("Thinker", 10 * GiB, "weights"),),
        peaks=(("text prefill", GiB, "2,048 tokens"),),
        kv=(KVPool("Thinker", 1 << 20, min_pages=64),),
        graphs=(GraphCandidates("Thinker", "decode", "batch", {1: 1 << 20, 2: 1 << 30}),),
    )
    device = DeviceMemory(total=40 * GiB, free=30 * GiB, allocated=10 * GiB, name="cuda:0")
    plan = plan_device(device, [stage], graph_budget=64 << 20)
    fake_pipeline.frontend = replace(fake_pipeline.frontend, plan_gauges=tuple(plan_gauges(plan)))
    metrics = TestClient(build_app(fake_pipeline, MODEL)).get("/metrics").text
    thinker_pages = float(plan.kv_pool("Thinker").pages)
    pages = f'omnistage_memory_plan_kv_pages{{device="cuda:0",stage="Thinker"}} {thinker_pages}'
    assert pages in metrics
    assert (
        'omnistage_memory_plan_bytes{device="cuda:0",part="weights",stage="Thinker"} 1.073741824e+10'
        in metrics
    )
    captured = (
        'omnistage_memory_plan_graphs{device="cuda:0",kind="decode",stage="Thinker",state="captured"} 1.0'
    )
    eager = 'omnistage_memory_plan_graphs{device="cuda:0",kind="decode",stage="Thinker",state="eager"} 1.0'
    assert captured in metrics and eager in metrics


def test_a_json_body_is_parsed_once_by_pydantic_core_and_what_it_refuses_by_json_loads(client, monkeypatch):
    """A chat body without surrogates is parsed by pydantic-core's parser and not again by FastAPI's
    json.loads; a body it refuses (here one starting with a byte-order mark, which json.loads takes) still
    parses, through json.loads, as before."""
    import starlette.requests

    loads, calls = starlette.requests.json.loads, []
    monkeypatch.setattr(starlette.requests.json, "loads", lambda *a, **k: calls.append(1) or loads(*a, **k))
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    headers = {**AUTH, "content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=raw.encode(), headers=headers)
    assert (r.status_code, len(calls)) == (200, 0)
    r = client.post("/v1/chat/completions", content=b"\xef\xbb\xbf" + raw.encode(), headers=headers)
    assert (r.status_code, len(calls)) == (200, 1)
    assert r.json()["choices"][0]["message"]["content"] == "hel"


@pytest.mark.parametrize(
    "text",
    [
        '{"top_k": 123456789012345678901234567890, "n": -0.0, "x": 1e400, "y": NaN, "z": 0.1}',
        '{"a": 1, "a": 2, "b": [true, false, null, 1.5E3, -7]}',
        '{"s": "\\u00e9\\ud83d\\ude00 \\" \\\\ \\n \\t", "t": "\xc3\xa9"}',
    ],
)
def test_pydantic_cores_json_gives_what_json_loads_gives(text):
    """The values the fast parse hands FastAPI are json.loads' (big integers whole, floats, escapes, pairs)."""
    import pydantic_core

    ours, theirs = pydantic_core.from_json(text.encode()), json.loads(text.encode())
    assert json.dumps(ours) == json.dumps(theirs)  # NaN compares unequal to itself; its spelling does not
    assert all(type(ours[k]) is type(theirs[k]) for k in theirs)
