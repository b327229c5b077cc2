"""A realtime turn prefilled while the user speaks: once the turn's audio passes a whole window of the audio
encoder (8 s), the conversation with that window is in the prefix cache before the commit, so the turn's
response finds the window's pages cached (recorded speech, looped: its loudest frame comes first, so the
window's log-mel floor is the whole turn's)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import soundfile
import soxr

from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens
from omnistage.server.app import build_app
from omnistage.server.realtime.early import MARGIN_S, WINDOW_S
from tests.server.conftest import serving
from tests.server.realtime_client import KEY, SPEECH, connect, in_loop, manual, pages_free, until

PAGE_SIZE = 16  # the tiny test server's (tiny_pipeline)

pytestmark = pytest.mark.usefixtures("replies_run_to_their_cap")


@pytest.fixture(scope="module")
def url(tiny_pipeline):
    with serving(build_app(tiny_pipeline, "tiny", api_key=KEY)) as base:
        yield base


def speech_24k(seconds: float) -> bytes:
    """The recorded utterance looped to `seconds`, as pcm16 at 24 kHz (the session's default input)."""
    audio, rate = soundfile.read(SPEECH, dtype="float32")
    audio = soxr.resample(audio, rate, 24_000)
    looped = np.tile(audio, int(seconds * 24_000 // len(audio)) + 1)[: int(seconds * 24_000)]
    return (looped * 32767).astype("<i2").tobytes()


def hits(pipeline) -> int:
    return pipeline.stats()["prefix_cache_hits"]


async def prefilled(pipeline, queries: int) -> None:
    """Wait for the early prefill: a query of the cache past `queries`, and every page let go."""
    async with asyncio.timeout(60):
        while pipeline.stats()["prefix_cache_queries"] <= queries or pipeline.stats()["kv_pages_used"]:
            await asyncio.sleep(0.05)


@in_loop
async def test_a_turn_past_a_window_finds_it_cached_at_the_commit(url, tiny_pipeline):
    pcm = speech_24k(WINDOW_S + MARGIN_S + 0.6)
    step = 24_000 * 2 // 2  # half a second of pcm16
    async with connect(url) as conn:
        await manual(conn, output_modalities=["text"], max_output_tokens=2)
        queries = tiny_pipeline.stats()["prefix_cache_queries"]
        for start in range(0, len(pcm), step):
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[start : start + step]).decode())
        await prefilled(tiny_pipeline, queries)
        before = hits(tiny_pipeline)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        (*_, done) = await until(conn, "response.done")
        assert done.response.status == "incomplete"  # its two tokens, max_output_tokens
        gained = hits(tiny_pipeline) - before
    # the turn's first window (its audio rows) was cached: without the early prefill only pages before the
    # audio (the instructions) could be found
    window_rows = audio_output_tokens(round(WINDOW_S * 100))
    assert gained >= window_rows // PAGE_SIZE * PAGE_SIZE
    await pages_free(tiny_pipeline)
