"""An autoregressive stage fed embedding rows, not ids (the Talker): the core's pool, scheduler and sampler
(autoregressive.py) over a row runner (row_runner.py).

A request's prompt is a block of rows with their M-RoPE positions. Each later step's input row comes from
outside (`feed`): the row after sampled token k can only be built once the caller has turned token k into it
(and whatever else it adds). A request whose next row is not there yet sits the step out, keeping its pages.
A step returns, for every request that sampled, the id and the final hidden state that produced it.

Every input row is kept, so a preempted request is recomputed from its rows like a prompt.

A request may come with the prefix-cache keys of its prompt's leading pages (prefix_keys.py), computed by its
caller from whatever its rows are a function of: the pool then gives it the cached pages of its longest cached
prefix, and its prefill starts after them, as a text stage's does (kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Sizes
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.attention import gather_bytes
from omnistage.engine.decode_ahead import Launched
from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.memory.measure import graph_candidates, module_bytes
from omnistage.engine.memory.plan import MAIN_POOL, KVPool, MemoryPlan, StageMemory, kv_bytes_per_page
from omnistage.engine.prefix_keys import PageKeys
from omnistage.engine.sampling import make_generator
from omnistage.engine.scheduler import ScheduledChunk
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.engine.stages.autoregressive import AutoregressiveStage
from omnistage.engine.stages.decoder import torch_module
from omnistage.engine.stages.row_runner import RowRunner, RowState
from omnistage.models.layers.rotary import PromptPositions
from omnistage.request import SamplingParams


@dataclass
class Sampled:
    """What one request got from a step: its new id and the hidden state `[H]` that produced it, or its error."""

    request_id: str
    token: int | None
    hidden: torch.Tensor | None
    finished: bool
    reason: str | None = None  # "stop", "length" or "error" once finished
    error: str | None = None


@dataclass
class InFlight:
    """A launched step (`RowStage.launch`) not yet applied: its chunks, the final hidden states `[n, H]` of
    its n sampling chunks and their sampled ids (`ids.sampled` on the device, row b the b-th sampling chunk's;
    None when no chunk samples), or the error that failed its one chunk."""

    chunks: list[ScheduledChunk[RowState]]
    hidden: torch.Tensor | None
    ids: Launched[RowState] | None
    error: Exception | None = None


_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


class RowStage(AutoregressiveStage[RowState]):
    """The stage over `runner`, with `num_pages` pages until its device's plan sizes them (`allocate`).
    `max_seq_len`: its longest sequence (prompt and fed rows), which its graphs hold; `decode_sizes` and
    `prefill_sizes`: the batch and token buckets of its graphs, as its config has them; `kv`: what its pool
    asks of the plan (default: one request of the longest length at least)."""

    runner: RowRunner

    def __init__(
        self,
        runner: RowRunner,
        *,
        num_pages: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_id: int,
        max_seq_len: int = 0,
        decode_sizes: Sizes[int] = (),
        prefill_sizes: Sizes[int] = (),
        kv: KVPool | None = None,
        name: str = "Talker",
    ) -> None:
        super().__init__(
            name, runner, runner.device, runner.page_size, max_num_seqs, max_num_batched_tokens, False
        )
        self.eos_token_id, self.max_seq_len = eos_token_id, max_seq_len
        self.decode_sizes, self.prefill_sizes = list(decode_sizes), list(prefill_sizes)
        self.kv = kv
        self.graph_pool: Any = None  # the pool its graphs were captured into (`allocate`)
        self.allocate_pages(num_pages)

    def memory(self) -> StageMemory:
        """Its weights, the peak bytes of a prefill of a whole step's rows, its KV pool and its graphs' measured
        costs (none where it runs in another dtype than bfloat16: the graph-safe MoE kernels need it)."""
        runner = self.runner
        cfg, bf16 = runner.cfg, runner.dtype == torch.bfloat16
        prefill = runner.profile_peak(self.max_batched_tokens).bytes
        prefill += gather_bytes(
            torch_module(runner.model), cfg.num_key_value_heads, cfg.head_dim, runner.dtype
        )
        page_bytes = kv_bytes_per_page(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.page_size,
            runner.dtype.itemsize,
        )
        pool = self.kv or KVPool(self.name, page_bytes, min_pages=-(-self.max_seq_len // self.page_size))
        decode = runner.graph_costs(self.decode_sizes if bf16 else [])
        prefill_costs = runner.prefill_graph_costs(self.prefill_sizes if bf16 else [])
        graphs = (
            graph_candidates(self.name, "decode", "batch", decode, MAIN_POOL),
            graph_candidates(self.name, "prefill", "tokens", prefill_costs, MAIN_POOL),
        )
        return StageMemory(
            resident=((self.name, module_bytes(torch_module(runner.model)), "weights"),),
            peaks=((f"{self.name} prefill", prefill, f"{self.max_batched_tokens:,} rows"),),
            kv=(pool,),
            graphs=tuple(g for g in graphs if g.costs),
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """Its pages and graphs as `plan` has them (the graphs record the pages' addresses, so the pages come
        first), the graphs into `pool` (the device's main-stream pool where another stage made it) or a new one,
        which `graph_pool` then holds for the device's later stages."""
        self.allocate_pages(plan.kv_pool(self.name).pages)
        # as the Thinker's: a first burst of prompts would otherwise pay the Talker's kernel builds (likely why
        # the H200's first c=4 pass had a 518 ms first packet, against 80 ms at c=1)
        self.runner.warm_up(self.max_batched_tokens)
        # the plan's buckets are typed for every set: batch and token counts here
        self.runner.capture_graphs(
            int_buckets(plan.captured(self.name, "decode")), self.max_seq_len, pool=pool
        )
        if pool is None and self.runner.graphs is not None:
            pool = self.runner.graphs.pool
        self.runner.capture_prefill_graphs(
            int_buckets(plan.captured(self.name, "prefill")), self.max_seq_len, pool=pool
        )
        if pool is None and self.runner.prefill_graphs is not None:
            pool = self.runner.prefill_graphs.pool
        self.graph_pool = pool

    # -- requests -----------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_embeds: torch.Tensor,
        positions: PromptPositions,
        params: SamplingParams,
        max_tokens: int,
        prefix: PageKeys | None = None,
    ) -> None:
        """Queue a request; raises RequestTooLarge when prompt + max_tokens could never fit the pool. `prefix`:
        the keys of its prompt's pages that may be shared (None: none is)."""
        state = RowState(
            rows=[prompt_embeds.to(self.runner.dtype)],
            positions=positions,
            params=params,
            generator=make_generator(params, self.device),
            eos_token_ids=[] if params.ignore_eos else [self.eos_token_id],
        )
        self.scheduler.add(
            Sequence(request_id, [0] * len(prompt_embeds), max_tokens, prefix=prefix, data=state)
        )

    def generator(self, request_id: str) -> torch.Generator | None:
        seq = self.scheduler.get(request_id)
        return None if seq is None else seq.data.generator

    def feed(self, request_id: str, row: torch.Tensor) -> None:
        """The input row `[H]` of the request's next step."""
        seq = self.scheduler.get(request_id)
        if seq is not None:
            seq.data.rows.append(row.to(self.runner.dtype).reshape(1, -1))

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

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[Sampled]:
        return self.settle(self.launch())

    def launch(self) -> list[InFlight]:
        """Schedule and launch one model step, its sampled ids left on their way to the host (`settle` applies
        them), so that the caller may launch work on them (`InFlight.ids`) before the host waits for them. A
        failure fails only its request (isolation.run_isolated): the step is then several, a chunk each."""
        out = self.scheduler.schedule(ready=_ready)
        if not out.chunks:
            return []
        return self.isolated(
            out.chunks,
            self._compute,
            lambda chunks, result: [InFlight(chunks, *result)],
            lambda chunk, exc: [InFlight([chunk], None, None, exc)],
        )

    def settle(self, flights: list[InFlight]) -> list[Sampled]:
        """Wait for the launched steps' ids and apply them: per sampling chunk, in order, what it got."""
        results = []
        for flight in flights:
            if flight.error is not None:
                results.append(self._fail(flight.chunks[0].seq, flight.error))
            else:
                assert flight.hidden is not None  # a step that did not fail has its hidden states
                results += self._apply(
                    flight.chunks, flight.hidden, flight.ids.tokens() if flight.ids else []
                )
        return results

    def _compute(
        self, chunks: list[ScheduledChunk[RowState]]
    ) -> tuple[torch.Tensor, Launched[RowState] | None]:
        sampling = [c for c in chunks if c.samples]
        hidden, logits = self.runner.execute(chunks)
        launched = Launched.start(sampling, self._sample(logits, sampling)) if logits is not None else None
        return hidden, launched

    def _apply(
        self, chunks: list[ScheduledChunk[RowState]], hidden: torch.Tensor, tokens: list[int]
    ) -> list[Sampled]:
        sampling = self.update(chunks, tokens)
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
    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledChunk[RowState]]) -> torch.Tensor:
        # ignore_eos: the end id is never drawn (unlike text, a stage's end id here is no output of its own);
        # written row by row, not through an index tensor that would be copied to the device each step
        ignoring = [row for row, c in enumerate(sampling) if c.seq.data.params.ignore_eos]
        if len(ignoring) == len(sampling):
            logits[:, self.eos_token_id] = -torch.inf
        else:
            for row in ignoring:
                logits[row, self.eos_token_id] = -torch.inf
        return self.sampler(logits, [self.sampling_row(c.seq) for c in sampling])

    def _fail(self, seq: Sequence[RowState], exc: Exception) -> Sampled:
        self.end_failed(seq, exc)
        return Sampled(seq.request_id, None, None, True, "error", seq.data.error)


def _ready(seq: Sequence[RowState]) -> bool:
    """Every row up to the sequence's last known position is there: the prompt, and one fed row per sample."""
    return len(seq.data.rows) >= seq.num_output_tokens + 1
