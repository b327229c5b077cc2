"""The Gate as plain ASGI, fed raw header bytes as a server hands them over (a test client would re-encode them)."""

from __future__ import annotations

import asyncio
import json

import pytest

from omnistage.server.gate import Gate

KEY = "clé-secrète"


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(authorization: bytes | None) -> tuple[int, bytes]:
    gate = Gate(_ok, api_key=KEY, max_body_bytes=1024, on_reject=lambda path, status: None)
    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"Bearer \xc3\xa9",
        b"Bearer \xff\xfe",
        "Bearer clé-secrète".encode("latin-1"),
        b"Basic x",
        b"Bearer",
    ],
)
def test_wrong_keys_of_any_bytes_are_401(header):
    status, body = call(header)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"


def test_a_non_ascii_key_sent_as_utf8_passes():
    assert call(f"Bearer {KEY}".encode()) == (200, b"ok")
    assert call(f"bearer  {KEY} ".encode()) == (200, b"ok")
