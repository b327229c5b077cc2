"""What every autoregressive stage is, whatever its step runner: a page pool, a scheduler and a sampler over the
runner's paged KV; a step's isolation (a failure fails only the requests at fault, isolation.py); the sampled ids
applied to the scheduler; a failed request ended with its error; and each request's sampling row.

The text stage (text.py: ids over a token runner, outputs and decode-ahead) and the row stage (rows.py: rows fed
by another stage over a row runner) are this core with their own requests and results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from omnistage.engine.isolation import run_isolated
from omnistage.engine.kv_cache import PagePool
from omnistage.engine.memory.measure import allocator_stats
from omnistage.engine.sampling import Sampler, SamplingRow
from omnistage.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.request import SamplingParams

if TYPE_CHECKING:
    from omnistage.engine.structured import GrammarState

log = logging.getLogger(__name__)

R = TypeVar("R")
Out = TypeVar("Out")


class StepRunner(Protocol):
    """The tensor side of a stage: it owns the KV tensors of every layer."""

    def allocate_kv(self, num_pages: int) -> None: ...


@dataclass(kw_only=True)
class SamplingState:
    """What a stage keeps per request to sample it: its parameters, its seeded generator (None: unseeded), the
    ids that end it, its place in its grammar (constrained decoding), and the error that failed it."""

    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: list[int]
    grammar: GrammarState | None = None
    error: str | None = None


S = TypeVar("S", bound=SamplingState)  # a stage's state of a request: what samples it, and more


class AutoregressiveStage(Generic[S]):
    """The bookkeeping of a stage over `runner`: its pool, scheduler and sampler, sized by `allocate_pages`; its
    sequences carry its state of their requests (`S`). `penalises_prompt`: the repetition penalty reads the
    prompt's ids as well as the outputs (a prompt of fed rows has no ids to read)."""

    pool: PagePool
    scheduler: Scheduler[S]

    def __init__(
        self,
        name: str,
        runner: StepRunner,
        device: torch.device,
        page_size: int,
        max_batch: int,
        max_batched_tokens: int,
        penalises_prompt: bool,
    ) -> None:
        self.name, self.runner, self.device = name, runner, device
        self.page_size, self.max_batch, self.max_batched_tokens = page_size, max_batch, max_batched_tokens
        self.penalises_prompt = penalises_prompt
        self.sampler = Sampler()

    def allocate_pages(self, num_pages: int) -> None:
        """A pool of `num_pages` pages, the runner's KV tensors for them, and a scheduler over the pool."""
        self.pool = PagePool(num_pages, self.page_size)
        self.runner.allocate_kv(num_pages)
        self.scheduler = Scheduler(self.pool, self.max_batch, self.max_batched_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def stats(self) -> dict[str, int]:
        stats = {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_used": self.pool.num_used,
            "kv_pages_cached": self.pool.num_cached,
            "prefix_cache_queries": self.pool.queried_tokens,
            "prefix_cache_hits": self.pool.hit_tokens,
        }
        if self.device.type == "cuda":
            stats.update(allocator_stats(self.device))
        return stats

    def sampling_row(self, seq: Sequence[S]) -> SamplingRow:
        """`seq`'s row of a step to sample. A sequence that ended on the ids applied after its step launched
        (decode_ahead.py) has nothing more its grammar allows; its row is sampled free, and its token dropped."""
        state = seq.data
        return SamplingRow(
            params=state.params,
            token_ids=seq.prompt_token_ids if self.penalises_prompt else [],
            output_token_ids=seq.output_token_ids,
            generator=state.generator,
            eos_token_ids=state.eos_token_ids,
            grammar=None if seq.is_finished else state.grammar,
        )

    def isolated(
        self,
        chunks: list[ScheduledChunk[S]],
        compute: Callable[[list[ScheduledChunk[S]]], R],
        apply: Callable[[list[ScheduledChunk[S]], R], list[Out]],
        fail: Callable[[ScheduledChunk[S], Exception], list[Out]],
    ) -> list[Out]:
        """`apply(chunks, compute(chunks))`, a failure failing only the requests at fault (isolation.py)."""
        return run_isolated(chunks, compute, apply, fail, generators)

    def update(self, chunks: list[ScheduledChunk[S]], tokens: list[int]) -> list[ScheduledChunk[S]]:
        """Apply a step's sampled ids, one per chunk that samples and in their order, to the scheduler; returns
        those chunks."""
        sampling = [c for c in chunks if c.samples]
        self.scheduler.update(
            SchedulerOutput(chunks), {c.seq.request_id: t for c, t in zip(sampling, tokens)}
        )
        return sampling

    def end_failed(self, seq: Sequence[S], exc: Exception) -> None:
        """End `seq` with its error (a no-op on its status if it had just finished)."""
        log.error("request %s failed in the %s stage", seq.request_id, self.name, exc_info=exc)
        seq.data.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)


def generators(chunks: list[ScheduledChunk[S]]) -> list[torch.Generator]:
    """The seeded generators the sampling chunks draw from."""
    return [g for c in chunks if c.samples and (g := c.seq.data.generator) is not None]
