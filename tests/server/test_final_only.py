"""Responses not streamed are handed their finished output alone (GenerationRequest.final_only), through the app
over the real engine (tiny checkpoint, CPU): one output delivered where a stream gets one per token, and the same
answer as the stream's."""

from __future__ import annotations

import asyncio
import io
from collections import Counter

import httpx
import soundfile
from fastapi.testclient import TestClient

from omnistage.models.qwen3_omni.code2wav import lookahead_samples
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.server.app import build_app

MODEL = "tiny"
TOKENS = 6
FORCED = {"max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "temperature": 0.0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}], **FORCED}


def spy(engine, monkeypatch) -> tuple[Counter, dict[str, bool]]:
    """Outputs each request's handler was handed, and each request's final_only, as the app asked for them."""
    delivered: Counter = Counter()
    final_only: dict[str, bool] = {}
    generate = engine.generate

    async def counted(request, preparing=None):
        final_only[request.request_id] = request.final_only
        async for output in generate(request, preparing):
            delivered[request.request_id] += 1
            yield output

    monkeypatch.setattr(engine, "generate", counted)
    return delivered, final_only


def only(final_only: dict[str, bool], delivered: Counter, flag: bool) -> list[int]:
    return [delivered[request_id] for request_id, asked in final_only.items() if asked is flag]


def test_a_response_not_streamed_gets_its_last_output_alone(tiny_pipeline, monkeypatch):
    delivered, final_only = spy(tiny_pipeline, monkeypatch)
    client = TestClient(build_app(tiny_pipeline, MODEL))
    whole = client.post("/v1/chat/completions", json=CHAT)
    assert whole.status_code == 200, whole.text
    assert only(final_only, delivered, True) == [1]
    assert whole.json()["usage"]["completion_tokens"] == TOKENS

    streamed_text = []
    with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                streamed_text += [
                    c["delta"].get("content") or ""
                    for c in httpx.Response(200, content=line[6:]).json()["choices"]
                ]
    assert only(final_only, delivered, False) == [TOKENS]
    assert "".join(streamed_text) == whole.json()["choices"][0]["message"]["content"]


def test_samples_and_completions_not_streamed(tiny_pipeline, monkeypatch):
    """n=2 chat samples and a completion: each sample delivered once, the usage counting every token."""
    delivered, final_only = spy(tiny_pipeline, monkeypatch)
    client = TestClient(build_app(tiny_pipeline, MODEL))
    samples = client.post("/v1/chat/completions", json=CHAT | {"n": 2, "temperature": 0.8, "seed": 3})
    assert samples.status_code == 200, samples.text
    assert len(samples.json()["choices"]) == 2 and samples.json()["usage"]["completion_tokens"] == 2 * TOKENS
    completion = client.post("/v1/completions", json={"model": MODEL, "prompt": "Rivers:", **FORCED})
    assert completion.status_code == 200, completion.text
    assert only(final_only, delivered, True) == [1, 1, 1] and not only(final_only, delivered, False)


def test_a_whole_wav_speech_is_delivered_once_with_all_its_audio(tiny_pipeline, monkeypatch):
    delivered, final_only = spy(tiny_pipeline, monkeypatch)
    frames = 30  # 1.2 s: a first chunk and a later one
    body = {
        "model": MODEL, "input": "Hello there.", "voice": "ethan", "response_format": "wav", "seed": 1,
        "max_frames": frames, "min_frames": frames, "ignore_eos": True,
    }  # fmt: skip

    async def ask() -> httpx.Response:
        app = build_app(tiny_pipeline, MODEL)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/audio/speech", json=body)

    response = asyncio.run(ask())
    assert response.status_code == 200, response.text
    audio, rate = soundfile.read(io.BytesIO(response.content))
    lookahead = lookahead_samples(Qwen3OmniConfig.from_dir(tiny_pipeline.pipeline.model_path).code2wav)
    # every frame's samples, from the last output alone
    assert rate == 24000 and len(audio) == frames * 1920 - lookahead
    assert only(final_only, delivered, True) == [1]
