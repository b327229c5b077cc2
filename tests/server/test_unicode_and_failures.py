"""Input that is not valid Unicode is a 400 naming its field, on a keep-alive connection that stays open; an
unexpected exception anywhere is a JSON 500 that names no internals and is logged with its traceback."""

from __future__ import annotations

import http.client
import json
import logging

import pytest
from fastapi.testclient import TestClient

from omnistage.media import MediaPolicy
from omnistage.server import build_app

OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # serving the checkpoint as "tiny"


def raw_json(fields: dict, **replace: str) -> bytes:
    """The body as JSON with each `replace` key's placeholder swapped for raw JSON text (escapes kept)."""
    text = json.dumps({"model": "tiny"} | fields)
    for placeholder, escaped in replace.items():
        text = text.replace(placeholder, escaped)
    return text.encode()


# (path, body, the field named in the error) — JSON escapes of lone surrogates, which json.loads accepts.
SURROGATES = [
    ("/v1/chat/completions", raw_json({**OK_CHAT, "messages": [{"role": "user", "content": "A"}]}, A="a\\ud800b"),
     "messages[0].content"),
    ("/v1/chat/completions",
     raw_json({**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "A"}]}]}, A="\\udfff"),
     "messages[0].content[0].text"),
    ("/v1/chat/completions", raw_json({**OK_CHAT, "stream": True, "messages": [{"role": "user", "content": "A"}]},
                                      A="\\ud83d"), "messages[0].content"),
    ("/v1/completions", raw_json({"prompt": "A", "max_tokens": 2}, A="\\udc00"), "prompt"),
    ("/v1/completions", raw_json({"prompt": ["A"], "max_tokens": 2}, A="\\udc00"), "prompt[0]"),
    ("/v1/chat/completions", raw_json({**OK_CHAT, "model": "MODEL"}, MODEL="omni\\ud800"), "model"),
    ("/v1/chat/completions", raw_json({**OK_CHAT, "stop": ["A"]}, A="\\ud800"), "stop[0]"),
    ("/v1/chat/completions", raw_json({**OK_CHAT, "metadata": {"KEY": "v"}}, KEY="\\ud800"), "metadata"),
    ("/v1/chat/completions", raw_json({**OK_CHAT, "temperature": "T"}, T="\\ud800"), "temperature"),
    # The same surrogate as the three bytes UTF-8 would give it (json.loads decodes with "surrogatepass").
    ("/v1/chat/completions",
     raw_json({**OK_CHAT, "messages": [{"role": "user", "content": "A"}]}).replace(b"A", b"\xed\xa0\x80"),
     "messages[0].content"),
]  # fmt: skip


def test_lone_surrogates_are_400_and_the_connection_stays_open(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.connect()
    sock = connection.sock
    for path, body, param in SURROGATES:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        assert response.status == 400, (path, body, payload)
        assert response.getheader("content-type") == "application/json"
        error = json.loads(payload)["error"]
        assert error["param"] == param, (body, error)
        assert "not valid Unicode" in error["message"], error
        assert response.getheader("connection") != "close"
    # A surrogate pair is a character like any other, and the same connection still serves.
    body = raw_json({**OK_CHAT, "messages": [{"role": "user", "content": "A"}]}, A="\\ud83d\\ude00")
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    response.read()
    assert connection.sock is sock
    connection.close()


def test_nul_byte_in_a_media_path_is_400(fake_pipeline, tmp_path):
    app = build_app(fake_pipeline, "m", media=MediaPolicy(media_dir=tmp_path))
    part = {"type": "audio_url", "audio_url": {"url": "speech\x00.wav"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    r = TestClient(app, raise_server_exceptions=False).post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "messages[0].content[0]: the path holds a NUL character"


def test_an_unexpected_exception_is_a_json_500_naming_no_internals(fake_pipeline, caplog):
    client = TestClient(build_app(fake_pipeline, "m"), raise_server_exceptions=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "boom"}]}
    with caplog.at_level(logging.ERROR):
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error == {
        "message": "the server failed this request (an internal error, logged)",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert logged and "secret internals" in str(logged[0].exc_info[1])
    metrics = client.get("/metrics").text
    assert 'omnistage_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0' in metrics
    assert (
        client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "ok"}]}
        ).status_code
        == 200
    )
