"""Malformed client events over a raw WebSocket: each is answered with an `error` event in OpenAI's shape (its
code, the field at fault, the event's id), and the session and the server go on serving."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import websockets

from omnistage.server.app import build_app
from omnistage.server.realtime.route import RealtimeLimits
from tests.server.conftest import serving
from tests.server.realtime_client import KEY, in_loop, tone

AUTH = {"Authorization": f"Bearer {KEY}"}
APPEND = "input_audio_buffer.append"
# (the frame, the error's code, its param)
BAD = [
    ("{", "invalid_json", None),
    ("[1, 2]", "invalid_type", None),
    ('{"event_id": "e1"}', "missing_required_parameter", "type"),
    ('{"type": "session.delete", "event_id": "e2"}', "invalid_value", "type"),
    ('{"type": "input_audio_buffer.append", "audio": 5}', "invalid_type", "audio"),
    ('{"type": "input_audio_buffer.append"}', "missing_required_parameter", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": "AA=="}', "invalid_value", "audio"),  # an odd byte
    ('{"type": "input_audio_buffer.commit", "extra": 1}', "unknown_parameter", "extra"),
    ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty", None),
    (
        '{"type": "session.update", "session": {"audio": {"input": {"turn_detection": '
        '{"type": "server_vad", "threshold": "high"}}}}}',
        "invalid_type",
        "session.audio.input.turn_detection.threshold",
    ),
    (
        '{"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}}',
        "invalid_value",
        "session.audio.output.voice",
    ),
    ('{"type": "session.update", "session": {"type": "transcription"}}', "invalid_value", "session.type"),
    (
        '{"type": "session.update", "session": {"output_modalities": ["video"]}}',
        "invalid_value",
        "session.output_modalities[0]",
    ),
    (
        '{"type": "session.update", "session": {"max_output_tokens": 0}}',
        "invalid_value",
        "session.max_output_tokens",
    ),
    (
        '{"type": "conversation.item.create", "item": {"type": "message", "role": "robot", "content": []}}',
        "invalid_value",
        "item.message.role",
    ),
    (
        '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "output_audio"}]}}',
        "invalid_value",
        "item.content[0].type",
    ),
    (
        '{"type": "conversation.item.create", "previous_item_id": "nope", "item": {"type": "function_call_output", "call_id": "c", "output": "{}"}}',
        "item_not_found",
        "item_id",
    ),
    ('{"type": "conversation.item.delete", "item_id": "nope"}', "item_not_found", "item_id"),
    (
        '{"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 5}',
        "item_not_found",
        "item_id",
    ),
    (
        '{"type": "conversation.item.truncate", "item_id": "x", "content_index": 0, "audio_end_ms": -1}',
        "invalid_value",
        "audio_end_ms",
    ),
    (
        '{"type": "response.create", "response": {"conversation": "none"}}',
        "invalid_value",
        "response.conversation",
    ),
    ('{"type": "response.cancel"}', "response_cancel_not_active", None),
]


@pytest.fixture(scope="module")
def ws_url(tiny_pipeline):
    with serving(build_app(tiny_pipeline, "tiny", api_key=KEY)) as base:
        yield base.replace("http", "ws") + "/v1/realtime?model=tiny"


async def receive(ws, kind: str) -> dict:
    async with asyncio.timeout(60):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == kind:
                return event


async def answered(ws) -> None:
    """The session still answers: a turn of text, and a text response of one token that ends."""
    text = {"type": "input_text", "text": "Hi."}
    await ws.send(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [text]},
            }
        )
    )
    await receive(ws, "conversation.item.done")
    await ws.send(
        json.dumps(
            {"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 1}}
        )
    )
    response = (await receive(ws, "response.done"))["response"]
    # sampled, the one token may end the turn itself (the tiny model's stop token): completed, not cut
    assert response["status"] in ("incomplete", "completed"), response
    if response["status"] == "incomplete":
        assert response["status_details"]["reason"] == "max_output_tokens", response


@in_loop
async def test_each_bad_event_gets_an_error_and_the_session_goes_on(ws_url):
    async with websockets.connect(ws_url, additional_headers=AUTH, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for frame, code, param in BAD:
            await ws.send(frame)
            async with asyncio.timeout(10):
                error = json.loads(await ws.recv())
            assert error["type"] == "error", frame
            assert (error["error"]["code"], error["error"]["param"]) == (code, param), (frame, error)
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
            given = json.loads(frame).get("event_id") if frame.startswith('{"') else None
            assert error["error"]["event_id"] == given
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Hi."}],
                    },
                }
            )
        )
        await receive(ws, "conversation.item.done")
        await ws.send(
            json.dumps(
                {
                    "type": "response.create",
                    "response": {"output_modalities": ["text"], "max_output_tokens": 40},
                }
            )
        )
        await ws.send(json.dumps({"type": "response.create", "event_id": "again"}))
        error = await receive(ws, "error")
        assert (error["error"]["code"], error["error"]["event_id"]) == (
            "conversation_already_has_active_response",
            "again",
        )
        await receive(ws, "response.done")
        await answered(ws)


@in_loop
async def test_huge_appends(ws_url):
    # 10 MB of base64 a frame: the second would pass the buffer's 300 s
    chunk = base64.b64encode(tone(160.0)).decode()
    async with websockets.connect(ws_url, additional_headers=AUTH, max_size=None) as ws:
        await ws.recv()
        await ws.send(
            json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        )
        await receive(ws, "session.updated")
        await ws.send(json.dumps({"type": APPEND, "audio": chunk}))
        await ws.send(json.dumps({"type": APPEND, "audio": chunk, "event_id": "big"}))
        error = await receive(ws, "error")
        assert (error["error"]["code"], error["error"]["event_id"]) == ("input_audio_buffer_full", "big")
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        await receive(ws, "input_audio_buffer.cleared")
        await answered(ws)
    # a frame past the WebSocket's own limit (16 MiB) closes that connection, and only that one
    async with websockets.connect(ws_url, additional_headers=AUTH, max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": APPEND, "audio": "A" * (17 << 20)}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
        assert closed.value.rcvd.code == 1009  # message too big
    async with websockets.connect(ws_url, additional_headers=AUTH, max_size=None) as ws:
        await ws.recv()
        await answered(ws)


@in_loop
async def test_a_conversation_past_its_limit_fails_the_response_alone(tiny_pipeline):
    app = build_app(tiny_pipeline, "tiny", api_key=KEY, realtime=RealtimeLimits(max_conversation_tokens=40))
    with serving(app) as base:
        url = base.replace("http", "ws") + "/v1/realtime?model=tiny"
        async with websockets.connect(url, additional_headers=AUTH) as ws:
            await ws.recv()
            text = {"type": "input_text", "text": "word " * 60}
            item = {"type": "message", "role": "user", "content": [text]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            created = await receive(ws, "conversation.item.done")
            await ws.send(
                json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}})
            )
            error = await receive(ws, "error")
            assert (error["error"]["code"], error["error"]["param"]) == (
                "context_length_exceeded",
                "conversation",
            )
            assert "at most 40" in error["error"]["message"]
            done = await receive(ws, "response.done")
            assert done["response"]["status"] == "failed"
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": created["item"]["id"]}))
            await receive(ws, "conversation.item.deleted")
            await answered(ws)  # within the limit again
