"""The scheduler tests' fakes: a model that computes through the page tables, and checks of every step."""

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.scheduler import Scheduler, SchedulerOutput
from omnistage.engine.sequence import Sequence, SequenceStatus

S = SequenceStatus


def next_token(history: list[int]) -> int:
    h = 0
    for t in history:
        h = (h * 31 + t) % 1_000_003
    return h % 1000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeModel:
    """Writes each chunk's tokens into a paged "KV cache" through the page tables and samples from what
    it reads back, so two sequences sharing a page, or a page table not covering the computed tokens,
    changes the generated tokens."""

    def __init__(self, pool: PagePool) -> None:
        self.page_size = pool.page_size
        self.kv: dict[tuple[int, int], int] = {}

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.page_ids[pos // self.page_size], pos % self.page_size

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for c in out.chunks:
            tokens = c.seq.all_token_ids
            for pos in range(c.start, c.start + c.num_tokens):
                self.kv[self._slot(c.seq, pos)] = tokens[pos]
        sampled = {}
        for c in out.chunks:
            if c.samples:
                history = [self.kv[self._slot(c.seq, pos)] for pos in range(c.start + c.num_tokens)]
                sampled[c.seq.request_id] = next_token(history)
        return sampled


def check_invariants(sched: Scheduler) -> None:
    pool = sched.pool
    owned = [p for s in sched.running for p in s.page_ids]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(owned) == pool.num_used
    assert len(owned) + pool.num_free == pool.num_pages
    assert len(sched.running) <= sched.max_num_seqs
    for s in sched.running:
        assert s.status is S.RUNNING
        assert len(s.page_ids) >= pool.pages_for(s.num_computed_tokens)
        assert s.num_computed_tokens < s.num_tokens
        assert sched.get(s.request_id) is s
    for s in sched.waiting:
        assert s.status is S.WAITING
        assert s.page_ids == [] and s.num_computed_tokens == 0
        assert sched.get(s.request_id) is s
    arrivals = [s.arrival for s in sched.running] + [s.arrival for s in sched.waiting]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len({id(c.seq) for c in out.chunks}) == len(out.chunks)
    for c in out.chunks:
        assert c.num_tokens >= 1
        assert c.seq.status is S.RUNNING
        assert c.start == c.seq.num_computed_tokens
        assert c.start + c.num_tokens <= c.seq.num_tokens
        assert c.samples == (c.start + c.num_tokens == c.seq.num_tokens)
        assert len(c.seq.page_ids) >= sched.pool.pages_for(c.start + c.num_tokens)
    for s in out.preempted:
        assert s.status is S.WAITING and s not in [c.seq for c in out.chunks]


def step(sched: Scheduler, model: FakeModel) -> SchedulerOutput:
    had_work = sched.has_unfinished()
    out = sched.schedule()
    check_step(sched, out)
    assert bool(out.chunks) == had_work, "no progress with requests pending"
    sched.update(out, model.step(out))
    check_invariants(sched)
    return out


def run_to_end(sched: Scheduler, model: FakeModel, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, model))
        assert len(outs) < max_steps, "scheduler did not drain"
    return outs


def make(request_id: str, prompt_len: int, max_tokens: int, base: int = 0) -> Sequence:
    return Sequence(request_id, [base + i + 1 for i in range(prompt_len)], max_tokens, data=None)


def setup(num_pages=16, page_size=4, max_num_seqs=8, budget=64):
    pool = PagePool(num_pages, page_size)
    return pool, Scheduler(pool, max_num_seqs, budget), FakeModel(pool)


def assert_done(seq: Sequence, status: SequenceStatus = S.FINISHED_LENGTH) -> None:
    assert seq.status is status
    assert seq.page_ids == []
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.max_tokens)


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]
