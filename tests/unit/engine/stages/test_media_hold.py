"""The encoder rows a text stage holds on its device (engine/stages/media_hold.py): requests wait unencoded while
their rows would pass the limit, rows leave the device once the prefill has passed them and come back for a
preempted request; on the tiny checkpoint (CPU, float32) the tokens are those of an unlimited engine."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import LLM, SamplingParams
from omnistage.engine.sequence import Sequence
from omnistage.engine.stages import text_admission
from omnistage.engine.stages.encoders import MultimodalEmbeds
from omnistage.engine.stages.host_rows import HostRows
from omnistage.engine.stages.media_hold import MediaHold, rows_bytes
from omnistage.models.multimodal import MultimodalInputs

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def inputs(audio=0, images=0, videos=0):
    return MultimodalInputs([], [audio] if audio else [], None, None, [images] if images else [],
                            num_video_tokens=[videos] if videos else [])  # fmt: skip


def embeds(audio_at=(), vision_at=(), hidden=4, levels=2):
    audio, vision = np.array(audio_at, dtype=np.int64), np.array(vision_at, dtype=np.int64)
    n = len(vision)
    return MultimodalEmbeds(
        torch.from_numpy(audio),
        torch.randn(len(audio), hidden) if len(audio) else None,
        torch.from_numpy(vision),
        torch.randn(n, hidden) if n else None,
        torch.randn(levels, n, hidden) if n else None,
        audio,
        vision,
    )


def sequence(rid, mm, prompt_len=40):
    return Sequence(rid, list(range(prompt_len)), 8, data=SimpleNamespace(mm=mm))


def test_requests_wait_while_their_rows_would_pass_the_limit():
    hold: MediaHold[str] = MediaHold(limit=None)
    hold.waiting.extend([("a", inputs(audio=3)), ("b", inputs(images=5))])
    assert hold.take() == ["a", "b"]  # no limit: every one at once

    hold = MediaHold(limit=1000)
    hold.waiting.extend([("a", inputs(audio=10)), ("b", inputs(audio=10)), ("c", inputs(images=4))])
    assert hold.take() == ["a"]  # rows of unknown size: alone, on an empty hold
    first = embeds(audio_at=range(10))  # 10 rows of 4 float32: 160 bytes
    hold.learn(inputs(audio=10), first)
    seq_a = sequence("a", first)
    hold.hold(seq_a, first)
    assert hold.held_bytes == rows_bytes(first) == 160
    assert hold.take() == ["b"]  # 160 + 160 fits; c's vision rows are of unknown size
    second = embeds(audio_at=range(10))
    hold.hold(sequence("b", second), second)
    vision = embeds(vision_at=range(4))  # 4 rows x (1 + 2 deepstack levels) x 16 bytes
    hold.learn(inputs(images=4), vision)
    assert hold.estimate(inputs(images=4)) == rows_bytes(vision) == 192
    assert hold.take() == ["c"]  # 320 + 192 fits
    hold.waiting.extend([("big", inputs(images=60)), ("small", inputs(audio=1))])
    assert (
        hold.take() == []
    )  # 60 vision rows (2,880 bytes) pass the limit: it waits, and so does what follows
    assert hold.drop("small") and not hold.drop("small") and len(hold) == 1


def test_a_request_larger_than_the_limit_goes_alone_on_an_empty_hold():
    hold: MediaHold[str] = MediaHold(limit=100)
    rows = embeds(audio_at=range(10))
    hold.learn(inputs(audio=10), rows)
    hold.waiting.extend([("big", inputs(audio=10)), ("next", inputs(audio=1))])
    assert hold.take() == ["big"]
    seq = sequence("big", rows)
    hold.hold(seq, rows)
    assert hold.take() == []
    seq.status = seq.status.FINISHED_STOPPED
    hold.release()
    assert hold.held_bytes == 0 and hold.take() == ["next"]


def test_images_and_videos_are_encoded_no_further_ahead_of_the_prefill_than_asked():
    hold: MediaHold[str] = MediaHold(limit=None, ahead_vision_rows=100)
    hold.waiting.extend(
        [
            ("v1", inputs(videos=60)),
            ("v2", inputs(videos=60)),
            ("clip", inputs(audio=10)),
            ("i", inputs(images=30)),
        ]
    )
    assert hold.take() == [
        "v1"
    ]  # v2 would put 120 vision rows ahead of the prefill; the rest keep their order
    rows = embeds(vision_at=range(5, 65))
    seq = sequence("v1", rows, prompt_len=80)
    hold.hold(seq, rows)
    assert hold.vision_rows_ahead() == 60 and hold.take() == []
    seq.num_computed_tokens = 24  # the prefill has passed 19 of v1's vision rows: 41 ahead
    assert hold.vision_rows_ahead() == 41 and hold.take() == []
    seq.num_computed_tokens = 45  # 20 ahead: v2's 60 fit beside them, the clip's none, the image's 30 not
    assert hold.take() == ["v2", "clip"]
    more = embeds(vision_at=range(60))
    hold.reserve(more)  # v2 encoded, its rows on their way to the host before it is queued: counted
    assert hold.vision_rows_ahead() == 80
    hold.reserve(more, count=False)
    hold.hold(sequence("v2", more, prompt_len=70), more)
    seq.num_computed_tokens = 65
    hold.release()  # v1's rows leave; v2's 60 are still ahead
    assert hold.vision_rows_ahead() == 60 and hold.take() == ["i"]

    clips: MediaHold[str] = MediaHold(limit=None, ahead_vision_rows=100)
    clips.waiting.extend((f"c{i}", inputs(audio=50)) for i in range(10))
    held = embeds(audio_at=range(50))
    clips.hold(sequence("before", held, prompt_len=60), held)
    assert len(clips.take()) == 10  # clips alone are taken together, however many audio rows they hold

    big: MediaHold[str] = MediaHold(limit=None, ahead_vision_rows=100)
    big.waiting.extend([("long", inputs(videos=500)), ("next", inputs(images=1))])
    assert big.take() == ["long"]  # on an empty hold a video past the bound is taken alone


def test_rows_leave_once_the_prefill_passed_them_and_come_back_for_a_preemption():
    hold: MediaHold[str] = MediaHold(limit=10_000)
    rows = embeds(audio_at=[3, 4, 5], vision_at=[9, 10])
    kept = [t.clone() for t in (rows.audio_embeds, rows.image_embeds, rows.deepstack)]
    seq = sequence("s", rows)
    hold.hold(seq, rows)
    seq.num_computed_tokens = 10  # row 10 not yet computed
    hold.release()
    assert hold.held_bytes == rows_bytes(rows) and seq.data.mm.image_embeds is not None
    seq.num_computed_tokens = 11
    hold.release()
    assert hold.held_bytes == 0 and hold.ready(seq) and not hold.needs_restore([seq])
    assert seq.data.mm.audio_embeds is None and seq.data.mm.deepstack is None
    assert seq.data.mm.audio_rows_host.tolist() == [3, 4, 5]  # what a chunk looks up stays
    seq.num_computed_tokens = 0  # preempted: its prompt is computed again
    assert not hold.ready(seq) and hold.needs_restore([seq])
    other = embeds(audio_at=range(700))  # 11,200 bytes: the hold is full
    holder = sequence("o", other, prompt_len=800)
    hold.hold(holder, other)
    hold.restore([seq], torch.device("cpu"))
    assert not hold.ready(seq)
    holder.status = holder.status.FINISHED_STOPPED
    hold.restore([seq], torch.device("cpu"))
    assert hold.ready(seq) and not hold.needs_restore([seq]) and hold.held_bytes == rows_bytes(seq.data.mm)
    mm = seq.data.mm
    for got, want in zip((mm.audio_embeds, mm.image_embeds, mm.deepstack), kept):
        assert torch.equal(got, want)
    seq.status = seq.status.FINISHED_ABORTED
    hold.release()
    assert hold.held_bytes == 0 and not hold.holding


def test_rows_the_prefix_keys_copied_to_the_host_are_not_copied_again():
    hold: MediaHold[str] = MediaHold()
    rows = embeds(audio_at=[0, 1], vision_at=[2, 3])
    copied = HostRows(rows.audio_embeds.clone(), rows.image_embeds.clone())
    seq = sequence("s", replace(rows, host_rows=copied))
    hold.hold(seq, seq.data.mm)
    seq.num_computed_tokens = 4
    hold.release()
    assert seq.data.mm.offloaded[0] is copied.audio and seq.data.mm.offloaded[1] is copied.image


# -- the stage on the tiny checkpoint -----------------------------------------------------------------------


def conversations(count):
    rng = np.random.default_rng(3)
    chats = []
    for i in range(count):
        clip = (0.3 * rng.standard_normal(8000 + 4000 * i)).astype(np.float32)
        image = Image.fromarray(rng.integers(0, 256, (56, 56 + 28 * (i % 2), 3), dtype=np.uint8))
        content = [{"type": "image", "image": image}, {"type": "audio", "audio": clip}]
        chats.append([{"role": "user", "content": [*content, {"type": "text", "text": f"Question {i}?"}]}])
    return chats


def make_llm(checkpoint, **kwargs):
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", page_size=4, **kwargs)


@pytest.fixture(scope="module")
def unlimited(tiny_checkpoint):
    return make_llm(tiny_checkpoint, num_kv_pages=512)


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def run_limited(llm, chats, limit, params=GREEDY):
    """The chats at once, the hold limited to `limit` bytes: their outputs, and the rows held and the requests
    waiting unencoded after each step."""
    engine = llm.engine
    engine.media.limit = limit
    most = []
    step = engine.step

    def watched():
        outputs = step()
        most.append((engine.media.held_bytes, len(engine.media)))
        return outputs

    engine.step = watched
    try:
        return llm.chat(chats, params), most
    finally:
        del engine.step
        engine.media.limit = None


def test_media_requests_wait_for_rows_and_give_the_tokens_of_an_unlimited_engine(tiny_checkpoint, unlimited):
    chats = conversations(4)
    expected = ids(unlimited.chat(chats, GREEDY))
    llm = make_llm(tiny_checkpoint, num_kv_pages=512)
    llm.chat(chats[:1], GREEDY)  # the rows' sizes are learned
    prompts = [llm.engine.processor.process_chat(c) for c in chats]
    one = max(llm.engine.media.estimate(p.mm) for p in prompts)
    outputs, seen = run_limited(llm, chats, int(one * 1.5))
    assert ids(outputs) == expected
    assert max(held for held, _ in seen) <= one * 1.5
    assert max(waiting for _, waiting in seen) >= 2  # the later ones waited unencoded
    engine = llm.engine
    assert engine.media.held_bytes == 0 and not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_preempted_request_gets_its_rows_back(tiny_checkpoint, unlimited):
    """A small pool and small steps preempt requests whose rows already left the device: they come back, and
    the tokens are those of an unlimited engine with a large pool."""
    chats = conversations(5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = ids(unlimited.chat(chats, params))
    # 5 x (27-40 prompt + 16) tokens need ~70 pages of 4; 24 preempt the newest as the others decode
    small = make_llm(tiny_checkpoint, num_kv_pages=24, max_num_batched_tokens=16, prefix_caching=False)
    restored = []
    restore = small.engine.media.restore

    def watched(waiting, device):
        before = sum(s.data.mm.offloaded is not None for s in waiting if s.data.mm is not None)
        restore(waiting, device)
        restored.append(
            before - sum(s.data.mm.offloaded is not None for s in waiting if s.data.mm is not None)
        )

    small.engine.media.restore = watched
    outputs, _ = run_limited(small, chats, None, params)
    assert ids(outputs) == expected
    assert sum(restored) >= 1
    engine = small.engine
    assert engine.media.held_bytes == 0 and not engine.media.holding
    assert engine.pool.num_free == engine.pool.num_pages


def test_an_abort_while_waiting_unencoded(tiny_checkpoint, unlimited):
    llm = make_llm(tiny_checkpoint, num_kv_pages=512)
    engine = llm.engine
    engine.media.limit = 1  # one request's rows at a time
    prompts = [engine.processor.process_chat(c) for c in conversations(3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p.token_ids, GREEDY, mrope=p.mrope, mm=p.mm)
    assert len(engine.media) == 2 and engine.num_waiting >= 2
    assert engine.abort("2") is None and len(engine.media) == 1
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert sorted(finished) == ["0", "1"]
    assert finished["1"] == ids(unlimited.chat(conversations(3)[1:2], GREEDY))[0]
    assert engine.media.held_bytes == 0 and engine.pool.num_free == engine.pool.num_pages


def test_the_stage_reports_what_waits_unencoded_and_the_rows_it_holds(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, num_kv_pages=512)
    engine = llm.engine
    engine.media.limit = 1
    prompts = [engine.processor.process_chat(c) for c in conversations(3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p.token_ids, GREEDY, mrope=p.mrope, mm=p.mm)
    stats = engine.stats()
    assert (
        stats["num_waiting"] == 3 and engine.media.held_bytes > 0
    )  # one queued with its rows, two unencoded
    assert (
        stats["encoder_rows_held_bytes"]
        == engine.media.held_bytes
        == rows_bytes(engine.scheduler.get("0").data.mm)
    )
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["encoder_rows_held_bytes"] == 0 and engine.stats()["num_waiting"] == 0


class Copy:
    """A copy's CUDA event, as `HostRows` reads it: not ended until the test says so, or until waited for."""

    waited = 0

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        Copy.waited += not self.done  # a wait that blocks
        self.done = True


def test_a_request_is_queued_once_its_rows_reached_the_host(tiny_checkpoint, unlimited, monkeypatch):
    """On a GPU the prefix keys' copy of a prompt's rows to the host is queued behind the encoders' work and
    not waited for (host_rows.py): while other requests run, a request is queued once its copy has ended, in
    arrival order, its rows counted in the hold meanwhile, and an abort drops it; with nothing else to run the
    copy is waited for. The tokens are those of an unlimited engine and every page and byte comes back."""
    chats = conversations(3)
    expected = ids(unlimited.chat(chats, GREEDY))
    copies = []

    def copy_rows(audio, image):
        copies.append(Copy())
        return HostRows(audio, image, copies[-1])

    monkeypatch.setattr(text_admission, "copy_rows", copy_rows)
    Copy.waited = 0
    llm = make_llm(tiny_checkpoint, num_kv_pages=512)
    engine = llm.engine
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("text", engine.processor.encode("Hello"), long)
    engine.step()
    prompts = [engine.processor.process_chat(c) for c in chats]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p.token_ids, GREEDY, mrope=p.mrope, mm=p.mm)
    queued = lambda: [i for i in range(3) if engine.scheduler.get(str(i)) is not None]  # noqa: E731
    assert len(copies) == 3 and queued() == [] and len(engine.admission) == 3
    assert engine.media.held_bytes == sum(rows_bytes(c.mm) for c in engine.admission._copying)
    engine.step()
    assert queued() == []
    copies[1].done = True  # the second's copy alone: the first still goes first
    engine.step()
    assert queued() == []
    copies[0].done = True
    engine.step()
    assert queued() == [0, 1]
    assert engine.abort("2") is None and len(engine.admission) == 0
    finished = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert [finished["0"], finished["1"]] == expected[:2] and Copy.waited == 0
    engine.add_request("3", prompts[2].token_ids, GREEDY, mrope=prompts[2].mrope, mm=prompts[2].mm)
    while engine.has_unfinished():  # nothing else runs: the copy is waited for
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert finished["3"] == expected[2] and Copy.waited == 1
    assert engine.media.held_bytes == 0 and engine.pool.num_free == engine.pool.num_pages
