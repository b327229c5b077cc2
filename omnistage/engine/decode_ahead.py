"""Decoding ahead: the next decode step is launched before the last one's sampled ids reach the host.

A synchronous step leaves the GPU idle while the host prepares it, and again while the host reads its sampled
ids back and applies them (stop checks, detokenizing, outputs): 0.9 ms of a 2.9 ms Qwen3-ASR 1.7B decode step
on an H200, whose graph replays in 2.0 ms back to back. Decoding ahead, the engine queues step N+1's forward pass
on the ids step N sampled, still on the device, and only then waits for step N's ids and applies them, while the
GPU computes step N+1; step N+1 is sampled after that. So a constrained sequence decodes ahead too: applying
step N's token advances its grammar, whose mask for step N+1 is filled on the host and copied up (pinned, not
waited for) while the forward pass runs, and the sampling queued behind the copy applies it.

The scheduler then runs one step ahead of what the host knows: when a step is sampled, each of its sampling
sequences gets a `PLACEHOLDER` token (the count is right, the value unknown), which the step's ids replace when
they arrive. A step launched ahead may hold prompt chunks beside its decode rows: a server under load admits
requests on most steps (Qwen3-ASR at c=128 admits ~4 a step), and a step that waited for the one before it
whenever a prompt arrived would leave the GPU idle while the host prepares it. Its input ids are the host's
where the host knows them (prompts, tokens read back) and the step in flight's sampled ids, on the device,
where it does not (`Launched.input_ids`). Only a step that reads no token's value on the host before its
sampling may run ahead (`may_run_ahead` over the running sequences, then `decodes_ahead` over those the step
admits): each of its sequences decodes ahead (its sampling reads no token values but through its grammar's
mask, filled once its forward pass is queued, and no later stage waits for its tokens), and it preempts
nothing (a preemption would recompute a placeholder). Anything else waits until the step in flight has been
applied. A sequence may end by length in a step launched ahead (a server of short replies ends one on most
steps): the scheduler ends it on its placeholder and frees its pages (the step's KV writes are queued before
any later step's), and reading the step back puts its last token in place and delivers its final output
(`awaits_token`). A sequence that stops on a token (its own stops, its grammar's end) is past its end in the step
launched after it: that step's token for it is sampled without its grammar and dropped. The log-probabilities
rows ask for travel with their ids: computed on the device in the same step, copied to the host beside them,
read with them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.logprobs import StepLogprobs
from omnistage.engine.scheduler import ScheduledChunk, Scheduler
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.models.layers.attention_metadata import to_device
from omnistage.outputs import TokenLogprobs
from omnistage.request import SamplingParams

log = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token launched but not yet read back; no vocabulary has it

Out = TypeVar("Out")
T = TypeVar("T")
S = TypeVar("S")  # the stage's state of a request


@dataclass
class Launched(Generic[S]):
    """A step in flight: its sampling chunks, the ids it sampled on the device, and their copy to the host (with
    the log-probabilities its rows asked for)."""

    chunks: list[ScheduledChunk[S]]  # the chunks that sample, in the step's order
    sampled: torch.Tensor  # [B] on the device, row b is chunks[b]'s
    host: torch.Tensor  # [B]: `sampled`, once `event` has completed
    event: torch.cuda.Event | None  # None off CUDA: the copy has completed
    logprobs: StepLogprobs | None = None  # on the host, once `event` has completed; None: no row asked
    rows: dict[Sequence[S], int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {chunk.seq: b for b, chunk in enumerate(self.chunks)}

    @classmethod
    def start(
        cls, chunks: list[ScheduledChunk[S]], sampled: torch.Tensor, logprobs: StepLogprobs | None = None
    ) -> Launched[S]:
        """Start copying `sampled` (and `logprobs`) to the host without waiting for it."""
        on_host = logprobs.to_host() if logprobs is not None else None
        if sampled.device.type != "cuda":
            return cls(chunks, sampled, sampled.cpu(), None, on_host)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(chunks, sampled, host, event, on_host)

    def input_ids(self, chunks: list[ScheduledChunk[S]]) -> torch.Tensor:
        """The next step's input ids `[rows]` on the device: the host's where it knows them, and this step's
        sampled ids for the last token of each sequence that sampled in it (a placeholder on the host)."""
        if all(chunk.num_tokens == 1 and chunk.seq in self.rows for chunk in chunks):
            index = [self.rows[chunk.seq] for chunk in chunks]
            if index == list(range(len(self.chunks))):
                return self.sampled
            return self.sampled.index_select(0, to_device(torch.tensor(index), self.sampled.device))
        ids: list[int] = []
        targets, sources = [], []
        for chunk in chunks:
            ids += chunk.seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            if ids[-1] == PLACEHOLDER:
                targets.append(len(ids) - 1)
                sources.append(self.rows[chunk.seq])
                ids[-1] = 0
        if PLACEHOLDER in ids:
            raise RuntimeError("a token in flight is not the last of its chunk")
        host = torch.tensor(ids + targets + sources)
        moved = to_device(host, self.sampled.device)
        step_ids, at, of = (
            moved[: len(ids)],
            moved[len(ids) : len(ids) + len(targets)],
            moved[len(ids) + len(targets) :],
        )
        return step_ids.index_copy(0, at, self.sampled.index_select(0, of))

    def tokens(self) -> list[int]:
        """The sampled ids on the host, waiting for their copy."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def token_logprobs(self, tokens: list[int]) -> list[TokenLogprobs | None]:
        """Each row's log-probabilities (None where it asked for none), once `tokens` were read back."""
        return self.logprobs.per_row(tokens) if self.logprobs is not None else [None] * len(tokens)


def settle(
    launched: Launched[S],
    apply: Callable[[Sequence[S], int, TokenLogprobs | None], list[Out]],
    fail: Callable[[Sequence[S], Exception], list[Out]],
) -> list[Out]:
    """Read back a launched step's ids (and logprobs) and `apply` each in place of its placeholder, or `fail`
    each sequence when the read fails. A sequence finished since (stopped on an earlier token, aborted) drops
    its token; one that ended by length on it takes it (`awaits_token`)."""
    try:
        tokens = launched.tokens()
        logprobs = launched.token_logprobs(tokens)
    except Exception as exc:
        return [out for c in launched.chunks if awaits_token(c) for out in fail(c.seq, exc)]
    outputs = []
    for chunk, token, token_logprobs in zip(launched.chunks, tokens, logprobs):
        seq = chunk.seq
        if not awaits_token(chunk):
            continue
        # its placeholder, the last of its outputs: a step launched after this one is sampled after `settle`
        seq.output_token_ids[chunk.start + chunk.num_tokens - seq.num_prompt_tokens] = token
        outputs += apply(seq, token, token_logprobs)
    return outputs


def launched_or_none(launch: Callable[[], T]) -> T | None:
    """What `launch` (a part of launching a step ahead) returns, or None where it fails: the step then runs
    again one step after the other."""
    try:
        return launch()
    except Exception:
        log.warning(
            "a decode step failed to launch ahead; it runs again one step after the other", exc_info=True
        )
        return None


def drop_placeholders(token_ids: list[int]) -> None:
    """End a finished sequence's tokens at the last one read back: its tokens in flight are not its."""
    while token_ids and token_ids[-1] == PLACEHOLDER:
        token_ids.pop()


def decodes_ahead(params: SamplingParams, feeds_a_stage: bool) -> bool:
    """Whether a request may decode ahead: its sampling reads the count of its tokens, not their values (no
    penalty; a grammar's mask reads the token before, but only once the forward pass is queued), and no later
    stage reads its tokens as they come (a spoken reply's feed the Talker, whose first packet would wait a step
    longer)."""
    penalised = (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )
    return not penalised and not feeds_a_stage


def may_run_ahead(scheduler: Scheduler[S], eligible: Callable[[Sequence[S]], bool]) -> bool:
    """Whether the next step may launch before the step in flight (if any) is read back, each running
    sequence `eligible` as `decodes_ahead` says, judged before it is scheduled: see the module's docstring.
    The step judges the sequences it then admits the same way. Pure bookkeeping."""
    running = scheduler.running
    if not running:
        return False
    if not all(eligible(seq) for seq in running):
        return False
    return _new_pages(scheduler.pool, running) <= scheduler.pool.num_free


def awaits_token(chunk: ScheduledChunk[S]) -> bool:
    """Whether the token a launched `chunk` sampled is still wanted: its sequence runs on, or ended by length
    on that very token (its placeholder stands until the token is read back). One that stopped on an earlier
    token or was aborted since has no use for it."""
    seq = chunk.seq
    if not seq.is_finished:
        return True
    at = chunk.start + chunk.num_tokens - seq.num_prompt_tokens
    return (
        seq.status is SequenceStatus.FINISHED_LENGTH
        and at < len(seq.output_token_ids)
        and seq.output_token_ids[at] == PLACEHOLDER
    )


def _new_pages(pool: PagePool, running: list[Sequence[S]]) -> int:
    """Pages the running sequences need for one more token each."""
    return sum(max(0, pool.pages_for(seq.num_tokens) - len(seq.page_ids)) for seq in running)
