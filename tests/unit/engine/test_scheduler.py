import random

import pytest
from scheduler_fakes import (
    FakeModel,
    assert_done,
    check_invariants,
    check_step,
    expected_output,
    make,
    run_to_end,
    setup,
    shape,
    step,
)

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.scheduler import ScheduledChunk, Scheduler
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.errors import InvalidRequest, RequestTooLarge

S = SequenceStatus


def test_single_request_prefills_then_decodes():
    pool, sched, model = setup()
    a = make("a", 6, 5)
    sched.add(a)
    assert (a.arrival, a.status, sched.num_waiting) == (0, S.WAITING, 1)
    outs = run_to_end(sched, model)
    assert [shape(o) for o in outs] == [
        [("a", 0, 6)],
        [("a", 6, 1)],
        [("a", 7, 1)],
        [("a", 8, 1)],
        [("a", 9, 1)],
    ]
    assert not outs[0].is_pure_decode and all(o.is_pure_decode for o in outs[1:])
    assert_done(a)
    assert a.num_computed_tokens == 10  # the last sampled token is never computed
    assert sched.get("a") is None and sched.num_running == 0
    assert pool.num_free == pool.num_pages


def test_empty_step_and_output_properties():
    _, sched, _ = setup()
    out = sched.schedule()
    assert out.chunks == [] and out.preempted == []
    assert out.num_tokens == 0 and not out.is_pure_decode
    seq = make("a", 3, 2)
    assert ScheduledChunk(seq, 0, 3).samples and not ScheduledChunk(seq, 0, 2).samples


def test_continuous_batching_joins_the_next_step():
    pool, sched, model = setup()
    a, b = make("a", 4, 6), make("b", 3, 2, base=50)
    sched.add(a)
    step(sched, model)
    step(sched, model)
    sched.add(b)
    out = step(sched, model)
    assert shape(out) == [("a", 5, 1), ("b", 0, 3)]
    assert out.num_tokens == 4 and not out.is_pure_decode
    out = step(sched, model)
    assert shape(out) == [("a", 6, 1), ("b", 3, 1)] and out.is_pure_decode
    run_to_end(sched, model)
    assert_done(a)
    assert_done(b)
    assert pool.num_free == pool.num_pages


def test_chunked_prefill_splits_exactly_under_the_budget():
    pool, sched, model = setup(num_pages=64, page_size=16, budget=32)
    a = make("a", 100, 3)
    sched.add(a)
    outs = run_to_end(sched, model)
    assert [shape(o) for o in outs] == [
        [("a", 0, 32)],
        [("a", 32, 32)],
        [("a", 64, 32)],
        [("a", 96, 4)],
        [("a", 100, 1)],
        [("a", 101, 1)],
    ]
    assert [o.chunks[0].samples for o in outs] == [False, False, False, True, True, True]
    assert_done(a)
    assert pool.num_free == pool.num_pages


def test_chunked_prefill_shares_the_budget_with_decodes():
    pool, sched, model = setup(num_pages=64, page_size=16, budget=32)
    a, b = make("a", 8, 4), make("b", 100, 2, base=200)
    sched.add(a)
    step(sched, model)
    sched.add(b)
    assert [shape(step(sched, model)) for _ in range(4)] == [
        [("a", 8, 1), ("b", 0, 31)],
        [("a", 9, 1), ("b", 31, 31)],
        [("a", 10, 1), ("b", 62, 31)],  # a samples its 4th token here and finishes
        [("b", 93, 7)],
    ]
    run_to_end(sched, model)
    assert_done(a)
    assert_done(b)
    assert pool.num_free == pool.num_pages


def test_fcfs_order_and_max_num_seqs():
    pool, sched, model = setup(max_num_seqs=2)
    seqs = [make(f"r{i}", 3, 2 + i, base=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert [s.arrival for s in seqs] == [0, 1, 2, 3]
    outs = run_to_end(sched, model)
    first_step = {}
    for i, o in enumerate(outs):
        assert len(o.chunks) <= 2
        for c in o.chunks:
            first_step.setdefault(c.seq.request_id, i)
    assert [first_step[s.request_id] for s in seqs] == sorted(first_step.values())
    assert first_step == {"r0": 0, "r1": 0, "r2": 2, "r3": 3}  # r2 waits for r0 to finish
    for s in seqs:
        assert_done(s)
    assert pool.num_free == pool.num_pages


def test_request_waits_for_free_pages_and_blocks_the_ones_behind_it():
    pool, sched, model = setup(num_pages=6, page_size=4)
    a = make("a", 12, 8)  # 3 pages now, up to 5
    big = make("big", 16, 4, base=100)  # 4 pages: fits the pool, not the free pages
    small = make("small", 2, 2, base=200)  # 1 page: would fit, but must not overtake
    sched.add(a)
    step(sched, model)
    sched.add(big)
    sched.add(small)
    while a.status is S.RUNNING:
        out = step(sched, model)
        assert [c.seq.request_id for c in out.chunks] == ["a"]
        assert sched.num_waiting == 2 and big.page_ids == [] and small.page_ids == []
    out = step(sched, model)
    assert shape(out) == [("big", 0, 16), ("small", 0, 2)]
    run_to_end(sched, model)
    for s in (a, big, small):
        assert_done(s)
    assert pool.num_free == pool.num_pages


def test_preemption_takes_the_newest_which_resumes_with_the_same_tokens():
    pool, sched, model = setup(num_pages=4, page_size=4)
    a, b = make("a", 4, 8), make("b", 4, 8, base=100)
    sched.add(a)
    sched.add(b)
    outs = []
    while not any(o.preempted for o in outs):
        outs.append(step(sched, model))
    out = outs[-1]
    assert out.preempted == [b] and shape(out) == [("a", 8, 1)]
    assert (b.status, b.page_ids, b.num_computed_tokens, b.num_preemptions) == (S.WAITING, [], 0, 1)
    assert list(sched.waiting) == [b] and b.num_output_tokens == 5
    assert pool.num_free == 1
    # b needs 3 pages for its 9 known tokens: it waits until a finishes, then prefills all 9 again.
    while a.status is S.RUNNING:
        assert [c.seq for c in step(sched, model).chunks] == [a]
    assert shape(step(sched, model)) == [("b", 0, 9)]
    run_to_end(sched, model)
    assert_done(a)
    assert_done(b)
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert pool.num_free == pool.num_pages


def test_a_sequence_that_cannot_grow_preempts_itself_when_newest():
    pool, sched, model = setup(num_pages=3, page_size=4)
    a, b = make("a", 6, 2), make("b", 4, 4, base=100)
    sched.add(a)
    sched.add(b)
    assert shape(step(sched, model)) == [("a", 0, 6), ("b", 0, 4)]
    out = step(sched, model)  # b needs a second page and none is free: b is the newest
    assert shape(out) == [("a", 6, 1)] and out.preempted == [b]
    assert a.status is S.FINISHED_LENGTH
    run_to_end(sched, model)
    assert_done(a)
    assert_done(b)
    assert pool.num_free == pool.num_pages


def test_preempts_several_newest_until_the_oldest_fits():
    pool, sched, model = setup(num_pages=4, page_size=2, budget=64)
    a, b, c = make("a", 2, 5), make("b", 2, 3, base=10), make("c", 2, 3, base=20)
    for s in (a, b, c):
        sched.add(s)
    preempted = []
    for out in run_to_end(sched, model):
        preempted += [s.request_id for s in out.preempted]
    assert preempted and "a" not in preempted
    for s in (a, b, c):
        assert_done(s)
    assert pool.num_free == pool.num_pages


def test_lone_sequence_filling_the_whole_pool_finishes():
    pool, sched, model = setup(num_pages=4, page_size=4, budget=3)
    a = make("a", 10, 6)  # exactly 16 tokens
    sched.add(a)
    outs = run_to_end(sched, model)
    assert [o.num_tokens for o in outs[:4]] == [3, 3, 3, 1]
    assert all(not o.preempted for o in outs)
    assert_done(a)
    assert pool.num_free == pool.num_pages


def test_admission_refuses_at_once_with_the_exact_message():
    pool = PagePool(num_pages=175, page_size=128)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=2048)
    seq = Sequence("big", [7] * 24_000, max_tokens=212, data=None)
    with pytest.raises(RequestTooLarge) as info:
        sched.add(seq)
    assert str(info.value) == "request needs 190 pages (24,212 tokens) but the pool has 175 pages"
    assert sched.num_waiting == 0 and sched.get("big") is None and not sched.has_unfinished()


def test_add_rejects_bad_requests():
    _, sched, _ = setup()
    with pytest.raises(InvalidRequest, match="empty"):
        sched.add(Sequence("a", [], 4, data=None))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sched.add(Sequence("a", [1], 0, data=None))
    sched.add(make("a", 2, 2))
    with pytest.raises(ValueError, match="already"):
        sched.add(make("a", 2, 2))
    assert sched.num_waiting == 1


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_abort_frees_pages_at_once(phase):
    pool, sched, model = setup(num_pages=16, page_size=4, budget=8)
    a, victim = make("a", 4, 10), make("v", 20, 10, base=100)
    sched.add(a)
    step(sched, model)
    sched.add(victim)
    if phase == "prefill":
        step(sched, model)
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    elif phase == "decode":
        while victim.num_output_tokens < 2:
            step(sched, model)
    expected_free = pool.num_free + len(victim.page_ids)
    assert sched.abort("v") is victim
    assert victim.status is S.FINISHED_ABORTED and victim.page_ids == []
    assert pool.num_free == expected_free
    assert sched.get("v") is None and sched.abort("v") is None and sched.abort("nope") is None
    check_invariants(sched)
    run_to_end(sched, model)
    assert_done(a)
    assert pool.num_free == pool.num_pages


def test_abort_between_schedule_and_update_is_skipped():
    pool, sched, model = setup()
    a, b = make("a", 4, 3), make("b", 4, 3, base=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = model.step(out)  # the client of b disconnects while the step runs
    sched.abort("b")
    sched.update(out, sampled)
    assert (b.num_computed_tokens, b.output_token_ids, b.status) == (0, [], S.FINISHED_ABORTED)
    assert (a.num_computed_tokens, a.num_output_tokens) == (4, 1)
    check_invariants(sched)
    run_to_end(sched, model)
    assert_done(a)
    assert pool.num_free == pool.num_pages


def test_engine_finishes_on_stop_and_frees_pages():
    pool, sched, model = setup()
    a, b = make("a", 4, 10), make("b", 3, 1, base=100)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    sched.finish(a, S.FINISHED_STOPPED)  # the engine saw a stop token
    assert (a.status, a.page_ids, sched.num_running) == (S.FINISHED_STOPPED, [], 0)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 1)
    # b hit its length on a token that is also a stop: the stop is reported, other labels are not
    assert b.status is S.FINISHED_LENGTH
    sched.finish(b, S.FINISHED_ERROR)
    assert b.status is S.FINISHED_LENGTH
    sched.finish(b, S.FINISHED_STOPPED)
    assert b.status is S.FINISHED_STOPPED
    with pytest.raises(ValueError):
        sched.finish(a, S.RUNNING)
    assert not sched.has_unfinished() and pool.num_free == pool.num_pages


def test_engine_can_fail_a_waiting_request():
    pool, sched, _ = setup()
    a = make("a", 4, 2)
    sched.add(a)
    sched.finish(a, S.FINISHED_ERROR)
    assert a.status is S.FINISHED_ERROR and sched.num_waiting == 0 and not sched.has_unfinished()
    assert pool.num_free == pool.num_pages


def test_update_requires_a_token_for_every_sampling_chunk():
    _, sched, model = setup()
    sched.add(make("a", 4, 2))
    out = sched.schedule()
    with pytest.raises(KeyError, match="'a'"):
        sched.update(out, {})


@pytest.mark.parametrize("seed", range(6))
def test_soak_random_arrivals_aborts_and_stops(seed):
    rng = random.Random(seed)
    pool = PagePool(num_pages=12, page_size=4)
    sched = Scheduler(
        pool, max_num_seqs=rng.choice([3, 5, 8]), max_num_batched_tokens=rng.choice([8, 16, 32])
    )
    model = FakeModel(pool)
    seqs: list[Sequence] = []
    refused = 0
    for i in range(2000):
        if i < 300 and rng.random() < 0.3:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            seq = Sequence(f"r{i}", prompt, rng.randint(1, 30), data=None)
            try:
                sched.add(seq)
                seqs.append(seq)
            except RequestTooLarge:
                assert pool.pages_for(len(prompt) + seq.max_tokens) > pool.num_pages
                refused += 1
        unfinished = [s for s in seqs if not s.is_finished]
        if unfinished and rng.random() < 0.03:
            sched.abort(rng.choice(unfinished).request_id)
        if i >= 300 and not sched.has_unfinished():
            break

        had_work = sched.has_unfinished()
        out = sched.schedule()
        check_step(sched, out)
        assert bool(out.chunks) == had_work, "no progress with requests pending"
        sampled = model.step(out)
        if out.chunks and rng.random() < 0.03:
            sched.abort(rng.choice(out.chunks).seq.request_id)
        sched.update(out, sampled)
        for c in out.chunks:
            if c.samples and rng.random() < 0.02:
                sched.finish(c.seq, S.FINISHED_STOPPED)
        check_invariants(sched)
    else:
        pytest.fail("the scheduler did not drain")

    assert not sched.has_unfinished() and pool.num_free == pool.num_pages
    assert refused > 0 and sum(s.num_preemptions for s in seqs) > 0
    for s in seqs:
        assert s.is_finished and s.page_ids == []
        expected = expected_output(s.prompt_token_ids, s.max_tokens)
        if s.status is S.FINISHED_LENGTH:
            assert s.output_token_ids == expected
        else:
            assert s.status in (S.FINISHED_STOPPED, S.FINISHED_ABORTED)
            assert s.output_token_ids == expected[: s.num_output_tokens]


def test_decodes_only_foretells_a_pure_decode_step():
    """Through arrivals, chunked prefills and finishes, `decodes_only` before a step says whether the step will be
    a pure decode one (the pipeline runs the Thinker beside the speech stages only then)."""
    _, sched, model = setup(num_pages=32, budget=5)
    arrivals = {0: [make("a", 7, 4)], 3: [make("b", 3, 5, base=40)], 6: [make("c", 12, 2, base=80)]}
    seen = set()
    for n in range(100):
        for seq in arrivals.get(n, []):
            sched.add(seq)
        if not sched.has_unfinished():
            break
        foretold = sched.decodes_only
        out = step(sched, model)
        assert foretold == out.is_pure_decode, n
        seen.add(foretold)
    assert seen == {True, False}


def test_a_long_prefill_starves_neither_newer_decodes_nor_a_new_request():
    """An old request's long prompt is prefilled in chunks beside a newer request's decodes (one token each
    step) and leaves half the step to a request that arrives meanwhile: its first token comes in the step it
    is admitted, not after the whole long prefill."""
    pool, sched, model = setup(num_pages=64, page_size=16, budget=32)
    long, short = make("long", 200, 2), make("short", 4, 8, base=300)
    sched.add(long)
    sched.add(short)
    first = step(sched, model)
    assert shape(first) == [("long", 0, 16), ("short", 0, 4)]  # half the step while short waited
    for _ in range(3):
        out = step(sched, model)
        assert shape(out) == [("long", out.chunks[0].start, 31), ("short", out.chunks[1].start, 1)]
    late = make("late", 6, 2, base=600)
    sched.add(late)
    out = step(sched, model)
    assert shape(out)[1:] == [("short", 7, 1), ("late", 0, 6)] and out.chunks[2].samples
    assert out.chunks[0].num_tokens == 16
    run_to_end(sched, model)
    for seq in (long, short, late):
        assert_done(seq)
    assert pool.num_free == pool.num_pages


def test_a_burst_of_long_prompts_is_prefilled_oldest_first():
    """Prompts longer than half a step arriving together: each step goes to the oldest one's prefill first (its
    first token after two steps, not three as when the step was split between the first two), and every
    step still computes a full budget until the prefills end."""
    pool, sched, model = setup(num_pages=64, page_size=4, budget=32)
    burst = [make(f"v{i}", 40, 3, base=100 * i) for i in range(3)]
    for seq in burst:
        sched.add(seq)
    first, second = step(sched, model), step(sched, model)
    assert shape(first) == [("v0", 0, 32)]
    assert shape(second) == [("v0", 32, 8), ("v1", 0, 24)] and second.chunks[0].samples
    assert shape(step(sched, model)) == [("v0", 40, 1), ("v1", 24, 16), ("v2", 0, 15)]
    run_to_end(sched, model)
    for seq in burst:
        assert_done(seq)
    assert pool.num_free == pool.num_pages


def test_long_prefills_under_way_leave_half_the_step_to_a_short_request():
    """Two long prompts and a short request behind them: the first prompt's prefill takes whole steps, the second
    starts in what is left, and once the short request heads the queue the running prompts' chunks together
    leave it half the step: its first token comes before either long prefill ends. (Each running prompt capped
    at half the step alone filled the step with the two, and the short one waited for one of them to end.)"""
    pool, sched, model = setup(num_pages=64, page_size=4, budget=32)
    long_a, long_b = make("a", 60, 2), make("b", 60, 2, base=100)
    sched.add(long_a)
    sched.add(long_b)
    assert shape(step(sched, model)) == [("a", 0, 32)]
    chat = make("chat", 5, 3, base=300)
    sched.add(chat)
    assert shape(step(sched, model)) == [("a", 32, 28), ("b", 0, 4)]
    out = step(sched, model)
    assert shape(out) == [("a", 60, 1), ("b", 4, 16), ("chat", 0, 5)] and out.chunks[-1].samples
    run_to_end(sched, model)
    for seq in (long_a, long_b, chat):
        assert_done(seq)
    assert pool.num_free == pool.num_pages


def test_only_the_finished_statuses_are_finished():
    finished = {s for s in SequenceStatus if s.is_finished}
    assert finished == {s for s in SequenceStatus if s.name.startswith("FINISHED_")}
    seq = Sequence("r", [1, 2], 4, data=None)
    for status in SequenceStatus:
        seq.status = status
        assert seq.is_finished is (status in finished)
