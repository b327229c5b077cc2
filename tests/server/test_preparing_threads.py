"""Requests are prepared on worker threads (the body parsed, the media decoded, the prompt laid out by the
processor), and a preparation may wait there: Qwen3-ASR's mel features wait for their batch on the GPU. The
server's event loop has threads for many requests at once: with the loop's default pool (min(32, cores + 4)
threads; 20 on a 16-core host) a c=128 load of short clips queued for a free thread before its features
were even asked for (benchmarks/RESULTS.md, "Requests prepared at once")."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx

from omnistage.server.app import build_app
from tests.server.conftest import serving

MODEL = "fake"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
AT_ONCE = 48  # more than any default pool's 32 threads


def test_many_requests_are_prepared_at_once(fake_pipeline, monkeypatch):
    """Each transcription's preparation waits until all of them are being prepared: they all get through only
    if the server prepares that many at once (else the barrier breaks after its timeout: 500s)."""
    barrier = threading.Barrier(AT_ONCE, timeout=20)
    processor = fake_pipeline.frontend.processor
    lay_out = processor.transcription

    def waiting(*args, **kwargs):
        barrier.wait()
        return lay_out(*args, **kwargs)

    monkeypatch.setattr(processor, "transcription", waiting)
    clip = SPEECH.read_bytes()

    async def transcribe_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/audio/transcriptions",
                        data={"model": MODEL, "max_tokens": "2"},
                        files={"file": ("clip.wav", clip, "audio/wav")},
                    )
                    for _ in range(AT_ONCE)
                )
            )

    with serving(build_app(fake_pipeline, MODEL)) as url:
        responses = asyncio.run(transcribe_all(url))
    assert [r.status_code for r in responses] == [200] * AT_ONCE, responses[0].text
    assert not barrier.broken
