"""LiveKit Agents' `openai.STT` in its realtime mode against `/v1/realtime?intent=transcription` (the tiny
checkpoint in this process; random weights: the transcript is noise, the protocol real): it streams a
recorded utterance with silence around it, and the server's VAD ends the turn and transcribes it."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from livekit import rtc
from livekit.agents import stt as agents_stt
from livekit.plugins import openai as livekit_openai

from omnistage.server.app import build_app
from tests.server.conftest import serving
from tests.server.realtime_client import KEY, in_loop, pages_free, spoken_turns


@pytest.fixture(scope="module")
def url(tiny_pipeline):
    with serving(build_app(tiny_pipeline, "tiny", api_key=KEY)) as base:
        yield base


@in_loop
async def test_livekit_streaming_stt(url, tiny_pipeline):
    clip = spoken_turns((300, 900))
    stt = livekit_openai.STT(base_url=f"{url}/v1", api_key=KEY, model="whisper-1", use_realtime=True)
    async with aiohttp.ClientSession() as http:
        stt._session = http  # outside an agent's job there is no shared HTTP session to take
        stream = stt.stream()
        pcm = (clip.audio * 32767).astype(np.int16)
        step = 24_000 // 50  # 20 ms frames, as a room's track delivers them
        for at in range(0, len(pcm) - step + 1, step):
            stream.push_frame(rtc.AudioFrame(pcm[at : at + step].tobytes(), 24_000, 1, step))
        finals = []
        async with asyncio.timeout(60):
            async for event in stream:
                if event.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT:
                    finals.append(event.alternatives[0].text)
                    break
        await stream.aclose()
        await stt.aclose()
    assert len(finals) == 1 and finals[0]
    await pages_free(tiny_pipeline)
