"""The scheduler with a prefix cache: cached pages taken at admission, shared, and keyed as their ids become known."""

import random

import pytest
from scheduler_fakes import FakeModel, assert_done, check_step, expected_output, run_to_end, shape, step

from omnistage.engine.decode_ahead import PLACEHOLDER
from omnistage.engine.kv_cache import PagePool
from omnistage.engine.prefix_keys import PageKeys, page_keys
from omnistage.engine.scheduler import Scheduler, SchedulerOutput
from omnistage.engine.sequence import Sequence, SequenceStatus

S = SequenceStatus


def keyed(request_id: str, prompt: list[int], max_tokens: int, page_size: int) -> Sequence:
    return Sequence(request_id, prompt, max_tokens, prefix=PageKeys.of_prompt(prompt, page_size), data=None)


class CachingModel(FakeModel):
    """FakeModel that also fails a step writing into a page of a sequence's cached prefix: a cached page is
    shared, and its content is fixed once entered."""

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for c in out.chunks:
            first_page = c.start // self.page_size
            assert first_page >= c.seq.num_cached_pages, f"{c.seq.request_id} writes into a cached page"
        return super().step(out)


def check_shared_pages(sched: Scheduler) -> None:
    """Every page's holders are the running sequences whose tables list it; free and used add up."""
    pool = sched.pool
    tables = [s.page_ids for s in sched.running]
    for table in tables:
        assert len(table) == len(set(table))
    counts: dict[int, int] = {}
    for p in (p for table in tables for p in table):
        counts[p] = counts.get(p, 0) + 1
    assert all(pool.holders(p) == counts.get(p, 0) for p in range(pool.num_pages))
    assert pool.num_used == len(counts) and pool.num_free + pool.num_used == pool.num_pages
    for s in sched.waiting:
        assert s.page_ids == [] and s.num_computed_tokens == 0 and s.num_cached_pages == 0


def test_an_admitted_prompt_starts_after_its_cached_pages():
    pool = PagePool(16, 4)
    sched, model = Scheduler(pool, 8, 64), CachingModel(pool)
    first = keyed("first", list(range(1, 11)), 3, 4)
    sched.add(first)
    run_to_end(sched, model)
    second = keyed("second", list(range(1, 9)) + [50, 51, 52], 3, 4)  # shares the first two pages
    sched.add(second)
    out = sched.schedule()
    assert shape(out) == [("second", 8, 3)] and second.page_ids[:2] == [0, 1]
    sched.update(out, model.step(out))
    run_to_end(sched, model)
    assert_done(first)
    assert_done(second)
    assert (pool.queried_tokens, pool.hit_tokens) == (21, 8)


def test_a_head_that_waits_for_pages_holds_no_cached_page_meanwhile():
    pool = PagePool(4, 4)
    sched, model = Scheduler(pool, 8, 64), CachingModel(pool)
    sched.add(keyed("warm", list(range(1, 5)) + [9], 1, 4))
    run_to_end(sched, model)
    sched.add(keyed("big", list(range(1, 10)), 4, 4))  # holds 3 pages, reaching a 4th as it decodes
    step(sched, model)
    waiter = keyed("waiter", list(range(1, 5)) + [7, 7, 7, 7, 7], 1, 4)
    sched.add(waiter)
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["big"]  # the waiter needs 2 fresh pages, 1 is free
    assert waiter.page_ids == [] and waiter.num_computed_tokens == 0
    sched.update(out, model.step(out))
    check_shared_pages(sched)
    run_to_end(sched, model)
    assert pool.num_free == pool.num_pages


def test_soak_shared_prefixes_turns_aborts_and_preemption():
    """A thousand short requests over shared system prompts and earlier turns, on a pool that preempts: every
    output is the one the prompt alone gives, no cached page is written, and the pool ends full with no
    holder left."""
    rng = random.Random(0)
    page_size = 4
    pool = PagePool(num_pages=14, page_size=page_size)
    sched, model = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=16), CachingModel(pool)
    systems = [[rng.randrange(1000) for _ in range(n)] for n in (4, 9, 13, 17)]
    seqs: list[Sequence] = []
    done: list[Sequence] = []
    aborted = 0
    while len(seqs) < 1000 or sched.has_unfinished():
        for _ in range(rng.randint(0, 3) if len(seqs) < 1000 else 0):
            if done and rng.random() < 0.3:  # the next turn: an earlier prompt, its answer and more
                before = rng.choice(done)
                prompt = before.all_token_ids + [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
            else:
                prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
            if len(prompt) > 36:
                prompt = prompt[-36:]
            seq = keyed(f"r{len(seqs)}", prompt, rng.randint(1, 8), page_size)
            sched.add(seq)
            seqs.append(seq)
        unfinished = [s for s in seqs if not s.is_finished]
        if unfinished and rng.random() < 0.05:
            sched.abort(rng.choice(unfinished).request_id)
            aborted += 1
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, model.step(out))
        for c in out.chunks:
            if c.samples and c.seq.is_finished and c.seq.status is S.FINISHED_LENGTH:
                done.append(c.seq)
        check_shared_pages(sched)

    assert pool.num_free == pool.num_pages and pool.num_used == 0
    assert all(pool.holders(p) == 0 for p in range(pool.num_pages))
    assert aborted > 0 and sum(s.num_preemptions for s in seqs) > 0
    assert pool.hit_tokens > 0.2 * pool.queried_tokens
    for s in seqs:
        expected = expected_output(s.prompt_token_ids, s.max_tokens)
        if s.status is S.FINISHED_LENGTH:
            assert s.output_token_ids == expected
        else:
            assert s.status is S.FINISHED_ABORTED and s.output_token_ids == expected[: s.num_output_tokens]


@pytest.mark.parametrize("ending", [S.FINISHED_STOPPED, S.FINISHED_ABORTED])
def test_decoded_pages_are_keyed_once_their_ids_are_known_and_at_a_good_end_only(ending):
    """Decoding ahead, a step runs on a token whose id the host learns later (PLACEHOLDER): a page holding one
    is keyed once it is known. A sequence that stops keys its last full pages as it ends; an aborted one keys
    nothing more, whatever the host knows, since its last step may have been cut short."""
    pool = PagePool(16, 4)
    sched = Scheduler(pool, 8, 64)
    seq = keyed("a", [1, 2, 3, 4, 5], 10, 4)
    sched.add(seq)
    for sampled in (6, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER):
        out = sched.schedule()
        sched.update(out, {"a": sampled})
    assert seq.num_computed_tokens == 8 and seq.num_cached_pages == 1  # rows 4-7: 5, 6 and two unknown
    seq.output_token_ids[1:] = [7, 8, 9]  # the steps in flight read back
    sched.finish(seq, ending)
    if ending is S.FINISHED_STOPPED:
        assert pool.cached_prefix(page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)) == [0, 1]  # a fresh pool's first
    else:
        assert pool.num_cached == 1
    assert pool.num_free == pool.num_pages
