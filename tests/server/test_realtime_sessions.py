"""Realtime sessions as resources and as voice agents run them, through the official SDK's realtime client:
server VAD on a recorded utterance, barge-in by speech, eight sessions at once, a client that vanishes
mid-answer, the session limit, the idle timeout, the handshake's refusals, a tool call and a transcription
session (random weights: the words are noise, the events, pages and timings real)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import websockets

from omnistage.server.app import build_app
from omnistage.server.realtime.route import RealtimeLimits
from tests.server.conftest import serving
from tests.server.realtime_client import (
    KEY,
    connect,
    in_loop,
    manual,
    pages_free,
    spoken_turns,
    stream,
    until,
)

IDLE_S = 1.5

pytestmark = pytest.mark.usefixtures("replies_run_to_their_cap")


@pytest.fixture(scope="module")
def url(tiny_pipeline):
    limits = RealtimeLimits(max_sessions=9, idle_timeout_s=IDLE_S)
    with serving(build_app(tiny_pipeline, "tiny", api_key=KEY, realtime=limits)) as base:
        yield base


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(found[1]) if found else 0.0


def phases(url: str) -> dict[str, float]:
    """The realtime phases' sums (seconds) by phase."""
    page = httpx.get(f"{url}/metrics").text
    found = re.findall(r'^omnistage_realtime_phase_seconds_sum\{phase="(\w+)"\} (\S+)$', page, re.M)
    return {phase: float(value) for phase, value in found}


@in_loop
async def test_server_vad_commits_the_turn_and_answers_it(url, tiny_pipeline):
    clip = spoken_turns((600, 900))
    ((start_ms, end_ms),) = clip.turns
    before = metric(url, "omnistage_realtime_first_audio_seconds_count")
    waited, spent = metric(url, "omnistage_realtime_first_audio_seconds_sum"), phases(url)
    async with connect(url) as conn:
        created = await conn.recv()
        assert created.session.audio.input.turn_detection.type == "server_vad"  # OpenAI's default
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 2})
        await until(conn, "session.updated")
        await stream(conn, clip.audio)
        events = await until(conn, "response.done")
    kinds = [e.type for e in events]
    started, stopped = (
        events[kinds.index("input_audio_buffer.speech_started")],
        events[kinds.index("input_audio_buffer.speech_stopped")],
    )
    assert abs(started.audio_start_ms - (start_ms - 300)) <= 100  # the prefix padding before the speech
    assert end_ms + 500 <= stopped.audio_end_ms <= end_ms + 800  # after the silence that ends the turn
    committed = events[kinds.index("input_audio_buffer.committed")]
    assert committed.item_id == started.item_id == stopped.item_id
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.usage.input_token_details.audio_tokens > 0
    assert "response.output_audio.delta" in kinds
    assert metric(url, "omnistage_realtime_first_audio_seconds_count") == before + 1
    # the phases split the end of speech to the first audio delta: each took some of it, together all of it
    added = {phase: total - spent.get(phase, 0.0) for phase, total in phases(url).items()}
    assert set(added) == {"lay_out", "to_engine", "encode", "queue", "prefill", "speak", "send"}
    assert min(added.values()) >= 0.0
    waited = metric(url, "omnistage_realtime_first_audio_seconds_sum") - waited
    assert sum(added.values()) == pytest.approx(waited, abs=1e-6)
    await pages_free(tiny_pipeline)


@in_loop
async def test_speech_over_an_answer_cancels_it(url, tiny_pipeline):
    clip = spoken_turns((300, 900))
    barge_ins = metric(url, "omnistage_realtime_barge_ins_total")
    async with connect(url) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 1})
        await until(conn, "session.updated")
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}
        )
        await conn.response.create(response={"max_output_tokens": 64})
        await until(conn, "response.output_audio.delta")
        await stream(conn, clip.audio)
        events = await until(conn, "response.done")
        kinds = [e.type for e in events]
        assert kinds.index("input_audio_buffer.speech_started") < len(kinds) - 1
        cut = events[-1].response
        assert cut.status == "cancelled" and cut.status_details.reason == "turn_detected"
        answered = await until(conn, "response.done")  # the speech that interrupted is answered in turn
        assert answered[-1].response.status == "incomplete"
    assert metric(url, "omnistage_realtime_barge_ins_total") == barge_ins + 1
    # every first audio delta after the user's speech has its phases, however its response ended
    page = httpx.get(f"{url}/metrics").text
    send = re.search(r'^omnistage_realtime_phase_seconds_count\{phase="send"\} (\S+)$', page, re.M)
    assert send is not None and float(send[1]) == metric(url, "omnistage_realtime_first_audio_seconds_count")
    await pages_free(tiny_pipeline)


@in_loop
async def test_eight_sessions_at_once(url, tiny_pipeline):
    async def one(n: int) -> str:
        async with connect(url) as conn:
            await manual(conn, output_modalities=["text"], max_output_tokens=3)
            text = {"type": "input_text", "text": f"Count to {n}."}
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [text]})
            await conn.response.create()
            done = (await until(conn, "response.done"))[-1].response
            assert done.usage.output_tokens == 3
            return done.output[0].content[0].text

    generated = metric(url, "omnistage_generation_tokens_total")
    answers = await asyncio.gather(*(one(n) for n in range(8)))
    assert len(answers) == 8 and all(answers)
    # the sessions' requests count in /metrics as HTTP requests do
    assert metric(url, "omnistage_generation_tokens_total") == generated + 8 * 3
    await pages_free(tiny_pipeline)
    assert metric(url, "omnistage_realtime_sessions") == 0


@in_loop
async def test_a_client_vanishing_mid_answer_frees_everything(url, tiny_pipeline):
    conn = await connect(url).enter()
    await manual(conn, max_output_tokens=64)
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}
    )
    await conn.response.create()
    await until(conn, "response.output_audio.delta")
    assert tiny_pipeline.stats()["kv_pages_used"] > 0
    conn._connection.transport.abort()  # the network goes: no close frame
    await pages_free(tiny_pipeline)
    assert metric(url, "omnistage_realtime_sessions") == 0


@in_loop
async def test_session_limit_idle_timeout_and_refusals(url):
    ws_url = url.replace("http", "ws") + "/v1/realtime?model=tiny"
    auth = {"Authorization": f"Bearer {KEY}"}
    for headers, query, status in (
        ({}, "", 401),
        ({"Authorization": "Bearer nope"}, "", 401),
        (auth, "x", 404),
    ):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(ws_url + query, additional_headers=headers)
        assert refused.value.response.status_code == status
    body = json.loads(refused.value.response.body)
    assert body["error"]["code"] == "model_not_found" and "'tinyx'" in body["error"]["message"]
    # a browser's key is a subprotocol, and the session answers in the subprotocol `realtime` it offered
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(ws_url, subprotocols=["realtime", "openai-insecure-api-key.nope"])
    assert refused.value.response.status_code == 401
    offered = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with websockets.connect(ws_url, subprotocols=offered) as browser:
        assert browser.subprotocol == "realtime"
        assert json.loads(await browser.recv())["type"] == "session.created"
    held = [await websockets.connect(ws_url, additional_headers=auth) for _ in range(9)]
    with pytest.raises(websockets.InvalidStatus) as full:
        await websockets.connect(ws_url, additional_headers=auth)
    assert full.value.response.status_code == 429
    assert "--max-sessions 9" in json.loads(full.value.response.body)["error"]["message"]
    # an idle session is told why, then closed
    ws = held[0]
    assert json.loads(await ws.recv())["type"] == "session.created"
    async with asyncio.timeout(IDLE_S + 5):
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == "session_expired"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd.code == 4000
    for ws in held:
        await ws.close()


@in_loop
async def test_transcription_session(url, tiny_pipeline):
    clip = spoken_turns((300, 700))
    generated = metric(url, "omnistage_generation_tokens_total")
    async with connect(url, intent="transcription") as conn:
        created = await conn.recv()
        assert created.session.type == "transcription"
        await conn.session.update(
            session={
                "type": "transcription",
                "audio": {"input": {"transcription": {"model": "whisper-1", "language": "en"}}},
            }
        )
        await until(conn, "session.updated")
        await stream(conn, clip.audio)
        events = await until(conn, "conversation.item.input_audio_transcription.completed")
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_stopped" in kinds and "response.created" not in kinds
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    completed = events[-1]
    assert completed.transcript == deltas
    assert completed.item_id == events[kinds.index("input_audio_buffer.committed")].item_id
    assert completed.usage.output_tokens > 0 and completed.usage.input_token_details.audio_tokens > 0
    assert metric(url, "omnistage_generation_tokens_total") == generated + completed.usage.output_tokens
    await pages_free(tiny_pipeline)
