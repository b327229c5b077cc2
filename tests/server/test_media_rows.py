"""A burst of image chats through the app over the real engine (tiny checkpoint, CPU) while the Thinker may hold
the encoder rows of one request at a time (engine/stages/media_hold.py): the others wait unencoded, every
request is answered as it is with no limit, and no rows or pages are held afterwards."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
from PIL import Image

from omnistage.server.app import build_app

MODEL = "tiny"


def image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def test_a_burst_of_images_waits_for_rows_and_gets_the_answers_of_no_limit(tiny_pipeline, monkeypatch):
    thinker = tiny_pipeline.pipeline.thinker
    app = build_app(tiny_pipeline, MODEL)

    async def ask(client: httpx.AsyncClient, i: int) -> str:
        content = [
            {"type": "image_url", "image_url": {"url": image_url(i)}},
            {"type": "text", "text": "What?"},
        ]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    async def burst(count: int) -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await asyncio.gather(*(ask(client, i) for i in range(count)))

    expected = asyncio.run(burst(6))
    waiting = []
    add_requests = thinker.add_requests
    monkeypatch.setattr(
        thinker,
        "add_requests",
        lambda requests: (add_requests(requests), waiting.append(len(thinker.media)))[0],
    )
    monkeypatch.setattr(thinker.media, "limit", 1)  # one request's rows at a time
    assert asyncio.run(burst(6)) == expected
    assert max(waiting) >= 1  # some waited unencoded
    assert thinker.media.held_bytes == 0 and not thinker.media.holding and len(thinker.media) == 0
    stats = tiny_pipeline.pipeline.stats()
    assert stats["encoder_rows_held_bytes"] == 0 and stats["kv_pages_used"] == 0
