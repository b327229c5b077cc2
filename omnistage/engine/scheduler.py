"""Continuous batching with chunked prefill and recompute preemption; pure bookkeeping, no tensors.

Every step is a list of chunks (sequence, first token, number of tokens). Running sequences go first in
arrival order, then waiting ones in FCFS order while the step has token budget, a free slot and free
pages. A running prompt's prefill chunk leaves a token for each newer running sequence that decodes; and
when the waiting head could be admitted and its prompt takes at most half a step, the running prompts' chunks
together leave it that half: a long prompt is prefilled over more steps, but a short request does not wait for
all of it. A long head gets no such share: splitting the step between two long prompts would only finish the
older one later (a burst of eight videos would be prefilled two at a time, each pair ending together, rather
than one after the other). The waiting queue is strictly FCFS: a head that does not fit the free pages blocks
the requests behind it (no overtaking), so a large request is never starved by a stream of small ones.

A request admitted with a prefix-cached prompt (kv_cache.py) takes the cached pages and starts its prefill after
them, and so does a preempted one readmitted; a head that waits for pages holds none meanwhile.

Invariant: every running sequence arrived before every waiting one, and only running sequences own
pages. Hence the oldest running sequence can always take the pages of the newer ones, and a lone
sequence that passed admission always fits the pool: the scheduler never deadlocks.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.sequence import Sequence, SequenceStatus, StateT
from omnistage.errors import InvalidRequest

# A sequence that ends so has every id it computed known: its last full pages are keyed then. An aborted or
# failed one keys nothing more (its last step may have been cut short).
_ENDED_WELL = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH})


@dataclass
class ScheduledChunk(Generic[StateT]):
    """`seq.all_token_ids[start:start + num_tokens]` are computed this step."""

    seq: Sequence[StateT]
    start: int
    num_tokens: int
    # Fixed at schedule time: the chunk ends at the last known token, so the engine samples after it.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput(Generic[StateT]):
    chunks: list[ScheduledChunk[StateT]] = field(default_factory=list)
    preempted: list[Sequence[StateT]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_pure_decode(self) -> bool:
        """Every chunk is one token that is then sampled (False for an empty step)."""
        return bool(self.chunks) and all(c.num_tokens == 1 and c.samples for c in self.chunks)


class Scheduler(Generic[StateT]):
    """The steps of one stage's sequences, each carrying the stage's state of its request (`StateT`)."""

    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence[StateT]] = deque()  # by arrival
        self.running: list[Sequence[StateT]] = []  # by arrival
        self._unfinished: dict[str, Sequence[StateT]] = {}
        self._next_arrival = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def decodes_only(self) -> bool:
        """The next step can only be a decode step: none waits, and every running sequence has one token left
        to compute (its last sampled one)."""
        return not self.waiting and all(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)

    def get(self, request_id: str) -> Sequence[StateT] | None:
        """The unfinished sequence of `request_id`, if any."""
        return self._unfinished.get(request_id)

    def add(self, seq: Sequence[StateT]) -> None:
        """Queue `seq`; raise RequestTooLarge at once if it could never fit the pool."""
        if not seq.prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        if seq.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {seq.max_tokens}")
        if seq.request_id in self._unfinished:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        self.pool.check_admissible(seq.num_prompt_tokens + seq.max_tokens)
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._unfinished[seq.request_id] = seq

    def schedule(self, ready: Callable[[Sequence[StateT]], bool] | None = None) -> SchedulerOutput[StateT]:
        """The next step. A stage whose inputs arrive from another stage passes `ready`: a sequence it says
        is not ready sits this step out, keeping its pages (a waiting head that is not ready waits, FCFS)."""
        out: SchedulerOutput[StateT] = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Prefill chunks leave room in the step: a token for every newer running sequence that decodes, and half
        # the step when a short request waits and could be admitted. Neither then waits for a long prompt's whole
        # prefill (a decode's next token, a new request's first one: a spoken reply's first packet).
        admitting = (
            bool(self.waiting) and len(self.running) < self.max_num_seqs and self._short(self.waiting[0])
        )
        room = max(1, budget // 2) if admitting else budget  # for the running prompts' chunks together
        decodes_after = self._decodes_after()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            if (ready is not None and not ready(seq)) or (left > 1 and room == 0):
                i += 1
                continue
            n = 1 if left == 1 else min(left, room, max(1, budget - decodes_after[i]))
            n = min(n, budget)
            if left > 1:
                room -= n
            while not self.pool.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the newest, possibly `seq` itself
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
                i += 1

        # Admitting right after a preemption would only hand the freed pages back and forth.
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if ready is not None and not ready(seq):
                break
            found = self.pool.take_prefix(seq)  # its prefill starts after its cached pages
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if (
                len(self.waiting) > 1
                and len(self.running) + 1 < self.max_num_seqs
                and self._short(self.waiting[1])
            ):
                n = min(n, max(1, self.max_num_batched_tokens // 2))  # as above, for the short one behind it
            if not self.pool.ensure_capacity(seq, seq.num_computed_tokens + n):
                # FCFS: the head waits for pages, and so does everyone behind it; holding none meanwhile
                self.pool.untake_prefix(seq, found)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def _short(self, seq: Sequence[StateT]) -> bool:
        """Whether what `seq` has left to prefill fits in half a step."""
        return seq.num_tokens - seq.num_computed_tokens <= max(1, self.max_num_batched_tokens // 2)

    def _decodes_after(self) -> list[int]:
        """For each running sequence, how many newer running ones have a single token to compute."""
        counts, newer = [0] * len(self.running), 0
        for i in range(len(self.running) - 1, -1, -1):
            counts[i] = newer
            seq = self.running[i]
            newer += seq.num_tokens - seq.num_computed_tokens == 1
        return counts

    def update(self, output: SchedulerOutput[StateT], sampled: dict[str, int]) -> None:
        """Record a finished step: `sampled` maps request id to the token drawn after each sampling chunk.

        Chunks of sequences finished since `schedule()` (aborted mid-step) are skipped. The engine calls
        `finish` for stop tokens, strings and errors after this; only the length limit is decided here.
        """
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert chunk.start == seq.num_computed_tokens, "a chunk was applied twice or out of order"
            seq.num_computed_tokens += chunk.num_tokens
            self.pool.cache_computed(seq)
            if not chunk.samples:
                continue
            if seq.request_id not in sampled:
                raise KeyError(f"no sampled token for request {seq.request_id!r}")
            seq.output_token_ids.append(sampled[seq.request_id])
            if seq.num_output_tokens >= seq.max_tokens:
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def finish(self, seq: Sequence[StateT], status: SequenceStatus) -> None:
        """End `seq` from any state and free its pages at once.

        On an already finished sequence this is a no-op, except that a stop found on the last allowed
        token turns FINISHED_LENGTH into FINISHED_STOPPED (the stop is the truer reason).
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.status.is_finished:
            if seq.status is SequenceStatus.FINISHED_LENGTH and status is SequenceStatus.FINISHED_STOPPED:
                seq.status = status
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if status in _ENDED_WELL:
                self.pool.cache_computed(seq)
        else:
            self.waiting.remove(seq)
        self.pool.release(seq)
        seq.status = status
        del self._unfinished[seq.request_id]

    def abort(self, request_id: str) -> Sequence[StateT] | None:
        """Cancel `request_id` in any state; returns its sequence, or None if it is not unfinished."""
        seq = self._unfinished.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def _preempt(self, seq: Sequence[StateT]) -> None:
        # Recompute style: prompt and generated tokens are prefilled again when it is readmitted.
        self.pool.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # it is newer than every running and older than every waiting one
