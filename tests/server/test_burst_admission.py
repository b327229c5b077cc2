"""A burst of requests through the app, over the real engine (tiny checkpoint, CPU): while the server is still
preparing some of them, the idle engine holds those handed over and admits the burst as one batch (one encoder
pass, one prefill step; pipeline/step_loop.py). A lone request is admitted without waiting."""

from __future__ import annotations

import asyncio

import httpx

from omnistage.server.app import build_app

MODEL = "tiny"


def test_a_burst_is_admitted_as_one_batch_and_a_lone_request_at_once(tiny_engine, monkeypatch):
    pipeline = tiny_engine.engine
    add_requests = pipeline.add_requests
    batches = []
    monkeypatch.setattr(
        pipeline, "add_requests", lambda requests: batches.append(len(requests)) or add_requests(requests)
    )
    send = tiny_engine._send
    coming = []  # each Add's count of requests still being prepared when it was sent
    monkeypatch.setattr(
        tiny_engine, "_send", lambda c: coming.append(getattr(c, "more_coming", None)) or send(c)
    )
    app = build_app(tiny_engine, MODEL)

    async def ask(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 2}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text

    async def burst(count: int) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await asyncio.gather(*(ask(client, i) for i in range(count)))

    asyncio.run(burst(4))
    assert batches == [4]
    adds = [c for c in coming if c is not None]
    assert len(adds) == 4 and adds[0] > 0 and adds[-1] == 0  # the first was held for the others
    batches.clear()
    coming.clear()
    asyncio.run(burst(1))
    assert batches == [1] and coming == [0]  # nothing else was being prepared: not held
