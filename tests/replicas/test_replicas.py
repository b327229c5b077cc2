"""Replicas of the tiny-model server on a real local Ray Serve (CPU): one ingress for every route, requests
spread over the replicas, /metrics of all of them, a killed replica replaced, and scaling under a burst."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import soundfile
import websockets.sync.client
from PIL import Image

ray = pytest.importorskip("ray", reason="Ray Serve is the optional `ray` extra")
from ray import serve  # noqa: E402

from omnistage.config import engine_config  # noqa: E402
from omnistage.ray import replica_app  # noqa: E402
from omnistage.ray.launch import Scaling  # noqa: E402
from omnistage.server.options import ServerOptions  # noqa: E402

MODEL = "tiny"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
REPLICA = "x-omnistage-replica"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """Ray on this machine with room for two replicas of one CPU each, and Serve's proxy on a free port."""
    ray.init(num_cpus=4, include_dashboard=False, namespace="omnistage-tests")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=256)
    try:
        yield config, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def two(cluster):
    config, url = cluster
    serve.run(replica_app(config, ServerOptions(MODEL), Scaling(replicas=2)), name="two", route_prefix="/")
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client
    serve.delete("two")


def running_replicas(app: str) -> int:
    states = serve.status().applications[app].deployments["omnistage"].replica_states
    return states.get("RUNNING", 0)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.5)


def wav_b64() -> str:
    return base64.b64encode(SPEECH.read_bytes()).decode()


def png_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


FORCED = {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True}


def post(client: httpx.Client, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def one_request(client: httpx.Client, kind: str) -> tuple[str, str]:
    """One request of `kind` checked whole; returns (kind, the replica that answered)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **FORCED}
    if kind == "chat":
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    elif kind == "stream":
        body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4
    elif kind == "image":
        parts = [{"type": "image_url", "image_url": {"url": png_url()}}, {"type": "text", "text": "What?"}]
        r = client.post(
            "/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": parts}]}
        )
        assert r.status_code == 200, r.text
        text_only = {**chat, "messages": [{"role": "user", "content": parts[1:]}]}
        placeholders = r.json()["usage"]["prompt_tokens"] - post(client, text_only)["usage"]["prompt_tokens"]
        assert placeholders >= 4, placeholders  # the image's, framed
    elif kind == "transcription":
        files = {"file": ("clip.wav", SPEECH.read_bytes(), "audio/wav")}
        r = client.post("/v1/audio/transcriptions", data={"model": MODEL, "max_tokens": "4"}, files=files)
        assert r.status_code == 200 and isinstance(r.json()["text"], str), r.text
    else:
        body = {
            "model": MODEL,
            "input": "Hi there.",
            "voice": "ethan",
            "response_format": "wav",
            "max_frames": 8,
        }
        r = client.post("/v1/audio/speech", json=body)
        assert r.status_code == 200, r.text
        audio, rate = soundfile.read(io.BytesIO(r.content))
        assert rate == 24_000 and len(audio) > 0
    return kind, r.headers[REPLICA]


def test_mixed_requests_through_one_ingress_spread_over_both_replicas(two):
    kinds = ["chat", "stream", "image", "transcription", "speech"] * 12
    with ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda kind: one_request(two, kind), kinds))
    assert Counter(kind for kind, _ in answered) == Counter(kinds)
    by_replica = Counter(replica for _, replica in answered)
    assert len(by_replica) == 2 and min(by_replica.values()) >= 5, by_replica

    # one scrape holds both replicas' counts, each labelled
    def counted() -> dict[str, float]:
        text = two.get("/metrics").text
        totals: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("omnistage_requests_total{") and 'status="200"' in line:
                replica = line.split('replica="')[1].split('"')[0]
                totals[replica] += float(line.rsplit(" ", 1)[1])
        return totals

    wait_for(lambda: sum(counted().values()) >= 60, 15, "the scrape counts every request")
    assert set(counted()) == set(by_replica)


def test_a_session_stays_on_one_replica_and_sessions_spread_over_both(two):
    def replica_of(session: str) -> str:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **FORCED}
        r = two.post("/v1/chat/completions", json=chat, headers={"x-session-id": session})
        assert r.status_code == 200, r.text
        return r.headers[REPLICA]

    with ThreadPoolExecutor(4) as pool:
        turns = list(pool.map(lambda _: replica_of("alpha"), range(12)))
        sessions = list(pool.map(replica_of, [f"s{i}" for i in range(16)]))
    assert len(set(turns)) == 1
    assert len(set(sessions)) == 2  # 16 sessions all hashed to one replica: 2 x 2^-16


def realtime_turns_by_replica(client: httpx.Client) -> Counter[str]:
    totals: Counter[str] = Counter()
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("omnistage_realtime_responses_total{"):
            totals[line.split('replica="')[1].split('"')[0]] += float(line.rsplit(" ", 1)[1])
    return totals


def test_a_realtime_sessions_turns_are_all_served_by_one_replica(two):
    before = realtime_turns_by_replica(two)
    ws_url = str(two.base_url).replace("http", "ws", 1).rstrip("/") + "/v1/realtime?model=" + MODEL
    with websockets.sync.client.connect(ws_url) as ws:

        def until(kind: str) -> dict:
            while (event := json.loads(ws.recv(timeout=120)))["type"] != kind:
                assert event["type"] != "error", event
            return event

        until("session.created")
        session = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 2}
        ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": session | {"audio": {"input": {"turn_detection": None}}},
                }
            )
        )
        until("session.updated")
        for _ in range(3):
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create"}))
            assert until("response.done")["response"]["status"] == "incomplete"  # its two tokens

    def gained() -> Counter[str]:
        return realtime_turns_by_replica(two) - before

    wait_for(lambda: sum(gained().values()) >= 3, 15, "the scrape counts the session's turns")
    assert list(gained().values()) == [3]  # one replica answered all three


def test_a_killed_replica_fails_its_requests_cleanly_and_is_replaced(two):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "stream": True}
    long |= {"max_tokens": 300, "min_tokens": 300, "ignore_eos": True}
    streams = []
    for _ in range(4):
        request = two.build_request("POST", "/v1/chat/completions", json=long)
        response = two.send(request, stream=True)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # under way
        streams.append((response, lines))
    replicas = {r.headers[REPLICA] for r, _ in streams}
    victim = next(iter(replicas))
    # the replica's actor (Serve names it by app, deployment and replica id) dies as a crashed process would
    ray.kill(ray.get_actor(f"SERVE_REPLICA::two#omnistage#{victim}", namespace="serve"), no_restart=True)

    for response, lines in streams:
        try:
            rest = [line for line in lines if line]
        except httpx.HTTPError:  # the connection was dropped: a clean failure for the client
            rest = None
        finally:
            response.close()
        if response.headers[REPLICA] == victim:
            assert rest is None or rest[-1:] != ["data: [DONE]"] or any('"error"' in x for x in rest)
        else:
            assert rest is not None and rest[-1] == "data: [DONE]"
            tokens = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
            assert tokens[-1]["choices"][0]["finish_reason"] == "length"

    # later requests are served meanwhile, and Serve starts a replica in the killed one's place
    for _ in range(6):
        assert one_request(two, "chat")[1] != victim
    wait_for(lambda: running_replicas("two") == 2, 180, "a replacement replica running")
    seen: set[str] = set()

    def both_serve() -> bool:  # the ingress' router learns of the new replica a moment after Serve runs it
        seen.update(one_request(two, "chat")[1] for _ in range(4))
        return len(seen) == 2

    wait_for(both_serve, 60, "the replacement replica serving")
    assert victim not in seen


def test_autoscaling_adds_a_replica_under_a_burst_and_removes_it_after(cluster, two):
    config, url = cluster
    serve.delete("two")
    scaling = Scaling(
        autoscale=(1, 2),
        target_ongoing_requests=1,
        upscale_delay_s=1,
        downscale_delay_s=3,
        look_back_period_s=2,
    )
    serve.run(replica_app(config, ServerOptions(MODEL), scaling), name="scaling", route_prefix="/")
    assert running_replicas("scaling") == 1
    burst = {"model": MODEL, "prompt": "x", "max_tokens": 400, "min_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=300) as client, ThreadPoolExecutor(6) as pool:
        pending = [pool.submit(client.post, "/v1/completions", json=burst) for _ in range(6)]
        wait_for(lambda: running_replicas("scaling") == 2, 120, "a second replica under the burst")
        assert all(f.result().status_code == 200 for f in pending)
    wait_for(lambda: running_replicas("scaling") == 1, 120, "back to one replica after the burst")
    serve.delete("scaling")
