"""Code2Wav's chunks read back a step late (`AudioReadback`, deferred as on a GPU): what each step delivers, and
a spoken reply through the tiny pipeline (CPU, float32) that comes out the same as read back at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import LLM
from omnistage.models.qwen3_omni.code2wav_streamer import AudioChunk
from omnistage.pipeline.audio_readback import AudioReadback
from tests.unit.pipeline.test_handoff import speaking


def chunk(request_id: str, value: float, final: bool = False) -> AudioChunk:
    return AudioChunk(request_id, torch.full((4,), value, dtype=torch.bfloat16), final)


def delivered(readback: AudioReadback, chunks: list[AudioChunk], urgent: bool = False) -> list[tuple]:
    return [(c.request_id, float(c.samples[0]), c.final) for c in readback.exchange(chunks, urgent)]


def test_deferred_chunks_come_with_the_next_step_in_order():
    readback = AudioReadback(deferred=True)
    assert delivered(readback, [chunk("a", 1.0), chunk("b", 2.0)]) == []
    assert delivered(readback, [chunk("a", 3.0, final=True)]) == [("a", 1.0, False), ("b", 2.0, False)]
    assert delivered(readback, []) == [("a", 3.0, True)]
    assert delivered(readback, []) == []


def test_a_step_with_a_first_chunk_delivers_at_once_after_the_step_before():
    readback = AudioReadback(deferred=True)
    delivered(readback, [chunk("a", 1.0)])
    assert delivered(readback, [chunk("b", 2.0)], urgent=True) == [("a", 1.0, False), ("b", 2.0, False)]
    assert delivered(readback, []) == []


def test_not_deferred_every_chunk_comes_in_its_own_step():
    readback = AudioReadback(deferred=False)
    assert delivered(readback, [chunk("a", 1.0)]) == [("a", 1.0, False)]
    samples = readback.exchange([chunk("a", 0.5)], urgent=False)[0].samples
    assert samples.dtype == np.float32 and samples.tolist() == [0.5] * 4


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4)


def spoken_steps(llm: LLM, request_id: str, deferred: bool) -> tuple[list[np.ndarray | None], list]:
    """Each step's audio of one spoken reply (None in a step without), read back as on a GPU or at once; the
    last output."""
    pipeline = llm.pipeline
    handoff = pipeline.steps.handoff
    handoff.readback = AudioReadback(deferred)
    try:
        assert pipeline.add_requests([speaking(llm, request_id, 6, 60)]) == [None]
        steps, last = [], None
        while pipeline.has_unfinished():
            mine = [out for out in pipeline.step() if out.request_id == request_id]
            steps.append(mine[0].audio_delta if mine else None)
            last = mine[0] if mine else last
    finally:
        handoff.readback = AudioReadback(deferred=False)
    return steps, last


def test_a_spoken_reply_read_back_a_step_late_is_the_same_reply(llm):
    at_once, last = spoken_steps(llm, "at-once", deferred=False)
    late, late_last = spoken_steps(llm, "late", deferred=True)
    chunks = [a for a in at_once if a is not None]
    assert len(chunks) >= 3  # the first chunk and at least two later ones
    assert np.array_equal(np.concatenate(chunks), np.concatenate([a for a in late if a is not None]))
    assert np.array_equal(last.audio, late_last.audio) and late_last.finished
    assert late_last.num_audio_frames == last.num_audio_frames == 60
    # the first chunk comes in the step that made it; each later one a step after
    first = next(i for i, a in enumerate(at_once) if a is not None)
    assert late[first] is not None and np.array_equal(late[first], at_once[first])
    later = [i for i, a in enumerate(at_once) if a is not None][1:]
    assert [i for i, a in enumerate(late) if a is not None][1:] == [i + 1 for i in later]
    assert len(late) == len(at_once) + 1  # the last chunk, and the reply's end, a step later
    stats = llm.pipeline.stats()  # and nothing held after it
    assert stats["kv_pages_used"] == 0 and stats["talker_kv_pages_free"] == stats["talker_kv_pages_total"]


def test_a_reply_aborted_with_a_chunk_on_its_way_frees_everything(llm):
    pipeline = llm.pipeline
    handoff = pipeline.steps.handoff
    handoff.readback = AudioReadback(deferred=True)
    try:
        assert pipeline.add_requests([speaking(llm, "cut", 6, 60)]) == [None]
        while not handoff.readback.pending and pipeline.has_unfinished():  # a chunk after the first, deferred
            pipeline.step()
        assert handoff.readback.pending
        pipeline.abort("cut")
        while pipeline.has_unfinished():
            assert all(o.request_id != "cut" or o.finished for o in pipeline.step())
    finally:
        handoff.readback = AudioReadback(deferred=False)
    stats = pipeline.stats()
    assert stats["kv_pages_used"] == 0 and stats["talker_kv_pages_free"] == stats["talker_kv_pages_total"]
