"""An autoregressive stage fed embedding rows, not ids (the Talker): page pool, scheduler, sampling.

A request's prompt is a block of rows with their M-RoPE positions. Each later step's input row comes from
outside (`feed`): the row after sampled token k can only be built once the caller has turned token k into it
(and whatever else it adds). A request whose next row is not there yet sits the step out, keeping its pages.
A step returns, for every request that sampled, the id and the final hidden state that produced it.

Every input row is kept, so a preempted request is recomputed from its rows like a prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnistage.engine.gpu_memory import device_peak
from omnistage.engine.isolation import run_isolated
from omnistage.engine.kv_cache import PagePool
from omnistage.engine.model_runner import positions_for
from omnistage.engine.sampling import Sampler, SamplingParams, SamplingRow, make_generator
from omnistage.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import TextConfig

log = logging.getLogger(__name__)


class EmbeddingModel(Protocol):
    def __call__(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _State:
    rows: list[torch.Tensor]  # the prompt block [L, H], then one [1, H] per fed step
    positions: PromptPositions
    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: list[int]
    error: str | None = None

    def inputs(self, start: int, count: int) -> torch.Tensor:
        prompt = self.rows[0]
        if start >= len(prompt) and count == 1:  # a decode step
            return self.rows[1 + start - len(prompt)]
        return torch.cat(self.rows)[start : start + count]


@dataclass
class Sampled:
    """What one request got from a step: its new id and the hidden state `[H]` that produced it, or its error."""

    request_id: str
    token: int | None
    hidden: torch.Tensor | None
    finished: bool
    reason: str | None = None  # "stop", "length" or "error" once finished
    error: str | None = None


_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass
class EmbeddingStage:
    model: EmbeddingModel
    cfg: TextConfig
    num_pages: int
    page_size: int
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_id: int
    suppressed_ids: list[int] = field(default_factory=list)  # never sampled

    def __post_init__(self) -> None:
        self.pool = PagePool(self.num_pages, self.page_size)
        self.scheduler = Scheduler(self.pool, self.max_num_seqs, self.max_num_batched_tokens)
        self.sampler = Sampler()
        self.kv_caches = self._allocate(self.num_pages)
        self._suppressed = torch.tensor(self.suppressed_ids, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def _allocate(self, num_pages: int) -> list[torch.Tensor]:
        shape = (2, num_pages, self.page_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def profile_peak(self, num_tokens: int) -> int:
        """Bytes an eager step over `num_tokens` prompt rows allocates at its peak (scratch KV, freed after)."""
        pages = -(-num_tokens // self.page_size)
        kv = self._allocate(pages)
        meta = AttentionMetadata.build([(0, num_tokens, list(range(pages)))], self.page_size, self.device)
        embeds = torch.randn(num_tokens, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        positions = torch.arange(num_tokens, device=self.device).expand(3, -1)
        with device_peak(self.device) as peak:
            self.model.compute_logits(self.model(embeds, positions, kv, meta)[-1:])
        del kv
        return peak.bytes

    # -- requests -----------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_embeds: torch.Tensor,
        positions: PromptPositions,
        params: SamplingParams,
        max_tokens: int,
    ) -> None:
        """Queue a request; raises RequestTooLarge when prompt + max_tokens could never fit the pool."""
        state = _State(
            rows=[prompt_embeds.to(self.dtype)],
            positions=positions,
            params=params,
            generator=make_generator(params, self.device),
            eos_token_ids=[] if params.ignore_eos else [self.eos_token_id],
        )
        self.scheduler.add(Sequence(request_id, [0] * len(prompt_embeds), max_tokens, data=state))

    def generator(self, request_id: str) -> torch.Generator | None:
        seq = self.scheduler.get(request_id)
        return None if seq is None else seq.data.generator

    def feed(self, request_id: str, row: torch.Tensor) -> None:
        """The input row `[H]` of the request's next step."""
        seq = self.scheduler.get(request_id)
        if seq is not None:
            seq.data.rows.append(row.to(self.dtype).reshape(1, -1))

    def cap(self, request_id: str, max_tokens: int) -> bool:
        """Lower the request's max_tokens; True if that finished it (it has sampled as many already)."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        seq.max_tokens = min(seq.max_tokens, max_tokens)
        if seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
            return True
        return False

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[Sampled]:
        out = self.scheduler.schedule(ready=_ready)
        return self._run(out.chunks) if out.chunks else []

    def _run(self, chunks: list[ScheduledChunk]) -> list[Sampled]:
        """One model step over `chunks`; a failure fails only its request (see isolation.run_isolated)."""
        return run_isolated(
            chunks,
            self._sample_step,
            self._apply,
            lambda chunk, exc: [self._fail(chunk.seq, exc)],
            lambda chunks: [g for c in chunks if c.samples and (g := c.seq.data.generator) is not None],
        )

    def _sample_step(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        sampling = [c for c in chunks if c.samples]
        hidden = self._execute(chunks)
        return hidden, self._sample(hidden, sampling).tolist() if sampling else []

    def _apply(self, chunks: list[ScheduledChunk], result: tuple[torch.Tensor, list[int]]) -> list[Sampled]:
        hidden, tokens = result
        sampling = [c for c in chunks if c.samples]
        self.scheduler.update(
            SchedulerOutput(chunks), {c.seq.request_id: t for c, t in zip(sampling, tokens)}
        )
        results = []
        for row, (chunk, token) in enumerate(zip(sampling, tokens)):
            seq = chunk.seq
            if token in seq.data.eos_token_ids:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            results.append(
                Sampled(seq.request_id, token, hidden[row], seq.is_finished, _REASONS.get(seq.status))
            )
        return results

    @torch.inference_mode()
    def _execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Final hidden states `[n, H]` of the chunks that end in a sample, in chunk order."""
        embeds = torch.cat([c.seq.data.inputs(c.start, c.num_tokens) for c in chunks])
        positions = torch.cat(
            [positions_for(c.start, c.num_tokens, c.seq.data.positions) for c in chunks], dim=1
        )
        meta = AttentionMetadata.build(
            [(c.start, c.num_tokens, c.seq.page_ids) for c in chunks], self.page_size, self.device
        )
        hidden = self.model(embeds, positions.to(self.device), self.kv_caches, meta)
        last_rows = meta.query_start_loc[1:].long() - 1
        sampling = torch.tensor([c.samples for c in chunks], device=self.device)
        return hidden[last_rows[sampling]]

    @torch.inference_mode()
    def _sample(self, hidden: torch.Tensor, sampling: list[ScheduledChunk]) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        if len(self._suppressed):
            logits[:, self._suppressed] = -torch.inf
        # ignore_eos: the end id is never drawn (unlike text, a stage's end id here is no output of its own)
        ignoring = [row for row, c in enumerate(sampling) if c.seq.data.params.ignore_eos]
        if ignoring:
            logits[torch.tensor(ignoring, device=logits.device), self.eos_token_id] = -torch.inf
        rows = [
            SamplingRow(
                params=c.seq.data.params,
                # the repetition penalty reads the generated ids only: the prompt rows have none
                token_ids=c.seq.output_token_ids,
                output_token_ids=c.seq.output_token_ids,
                generator=c.seq.data.generator,
                eos_token_ids=c.seq.data.eos_token_ids,
            )
            for c in sampling
        ]
        return self.sampler(logits, rows)

    def _fail(self, seq: Sequence, exc: Exception) -> Sampled:
        log.error("request %s failed in an embedding stage", seq.request_id, exc_info=exc)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        return Sampled(seq.request_id, None, None, True, "error", f"{type(exc).__name__}: {exc}")


def _ready(seq: Sequence) -> bool:
    """Every row up to the sequence's last known position is there: the prompt, and one fed row per sample."""
    return len(seq.data.rows) >= seq.num_output_tokens + 1
