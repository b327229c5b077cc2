"""The tensor side of a row stage (rows.py): the KV tensors of every layer, a step's fed rows turned into the
final hidden states and masked logits of the rows that sample, and the decode and prefill graphs that replay it.

On a GPU, a step where every request feeds one row (a decode step) can replay a CUDA graph per batch bucket
(`capture_graphs`): the graph computes the final hidden states and the masked logits, so only sampling runs
eagerly. Other steps (prompts, recomputes, mixed steps, batches beyond the largest bucket) run eagerly, or
through a prefill graph per token bucket (`capture_prefill_graphs`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from omnistage.engine.graphs import DecodeGraphs, PrefillGraphs
from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.graphs.prefill import StaticPrefillBuffers
from omnistage.engine.memory.measure import Peak, device_peak, scaled_peaks
from omnistage.engine.scheduler import ScheduledChunk
from omnistage.engine.stages.autoregressive import SamplingState
from omnistage.engine.stages.decoder import (
    DecoderSizes,
    RowDecoder,
    moe_routing,
    torch_module,
    warm_attention,
)
from omnistage.engine.stages.token_runner import positions_for, warm_up_shapes
from omnistage.models.layers.attention_metadata import AttentionMetadata, to_device
from omnistage.models.layers.rotary import PromptPositions

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RowState(SamplingState):
    """A request's rows and positions, beside what samples it."""

    rows: list[torch.Tensor]  # the prompt block [L, H], then one [1, H] per fed step
    positions: PromptPositions

    def inputs(self, start: int, count: int) -> torch.Tensor:
        """Rows start..start+count `[count, H]`: a slice of the prompt, fed rows, or both (a recompute)."""
        prompt, end = self.rows[0], start + count
        if end <= len(prompt):
            return prompt[start:end]
        fed = self.rows[1 + max(0, start - len(prompt)) : 1 + end - len(prompt)]
        if start >= len(prompt) and count == 1:  # a decode step
            return fed[0]
        return torch.cat([prompt[start:], *fed])


class RowRunner:
    """Owns the KV tensors of every layer and, on a GPU, the decode and prefill graphs. `suppressed_ids` are
    never sampled (their logits are -inf); a prefill graph holds up to `max_seqs` prompts."""

    def __init__(
        self,
        model: RowDecoder,
        cfg: DecoderSizes,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_seqs: int,
        suppressed_ids: list[int],
    ) -> None:
        self.model, self.cfg, self.page_size = model, cfg, page_size
        self.device, self.dtype, self.max_seqs = device, dtype, max_seqs
        self.suppressed_ids = suppressed_ids
        self._suppressed = torch.tensor(suppressed_ids, dtype=torch.long, device=device)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    def allocate_kv(self, num_pages: int) -> None:
        self.kv_caches = self._allocate(num_pages)

    @torch.inference_mode()
    def _allocate(self, num_pages: int) -> list[torch.Tensor]:
        shape = (2, num_pages, self.page_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def profile_peak(self, num_tokens: int, num_seqs: int = 1) -> Peak:
        """Bytes an eager step of `num_seqs` prompts sharing `num_tokens` rows allocates at its peak, with the
        logits of each one's last row (scratch KV, freed after), and what it keeps at its end (the hidden
        states and logits: a graph's outputs). As many prompts as rows: a decode step."""
        per_seq = -(-num_tokens // num_seqs)
        pages = -(-per_seq // self.page_size)
        kv = self._allocate(num_seqs * pages)
        chunks = [(0, per_seq, list(range(i * pages, (i + 1) * pages))) for i in range(num_seqs)]
        meta = AttentionMetadata.build(chunks, self.page_size, self.device)
        embeds = torch.randn(per_seq * num_seqs, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        positions = torch.arange(per_seq, device=self.device).repeat(num_seqs).expand(3, -1)
        with device_peak(self.device) as peak:
            hidden = self.model(embeds, positions, kv, meta)
            logits = self._logits(hidden[meta.query_start_loc[1:].long() - 1])
        del kv, hidden, logits
        return peak

    def warm_up(self, max_tokens: int) -> None:
        """Run the eager step shapes traffic brings (`token_runner.warm_up_shapes`), so that kernel builds and compiled
        variants happen at start, not in the first requests' prefills (GPU only)."""
        for tokens, seqs in warm_up_shapes(max_tokens, moe_routing(self.cfg)):
            self.profile_peak(tokens, seqs)
        warm_attention(torch_module(self.model), self.dtype, self.device)

    # -- decode graphs ------------------------------------------------------------------------------

    def graph_costs(self, buckets: Iterable[int]) -> dict[int, Peak]:
        """What each bucket's decode graph is expected to take, for the memory plan: the measured peak of the
        largest bucket's eager decode step and what it keeps, scaled by batch (as the Thinker's)."""
        buckets = sorted(set(buckets))
        if not buckets:
            return {}
        return scaled_peaks(self.profile_peak(buckets[-1], buckets[-1]), buckets)

    def capture_graphs(self, buckets: Iterable[int], max_seq_len: int, pool: Any = None) -> list[int]:
        """Capture a decode graph per batch bucket for requests up to `max_seq_len` rows (prompt and fed rows);
        returns the buckets captured. `pool`: a graph memory pool shared with other graph sets of the device
        (`stage.graphs.pool` gives this one's): only one of them may run at a time. Off CUDA, binds eager calls
        over the same static buffers (tests); on CUDA, only in bfloat16 (the graph-safe MoE kernels need it)."""
        buckets = sorted(set(buckets))
        if not buckets:
            return []
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            log.warning(
                "CUDA graphs need bfloat16 (the GPU MoE kernels); Talker steps in %s run eagerly", self.dtype
            )
            return []
        self.graphs = DecodeGraphs(
            self._decode_step, buckets[-1], -(-max_seq_len // self.page_size), max_seq_len, self.device,
            row_shape=(self.cfg.hidden_size,), dtype=self.dtype,
        )  # fmt: skip
        with torch.inference_mode():
            return int_buckets(self.graphs.capture(buckets, pool=pool))

    # -- prefill graphs ------------------------------------------------------------------------------

    def prefill_graph_costs(self, buckets: Iterable[int]) -> dict[int, Peak]:
        """What each token bucket's prefill graph is expected to take: the largest one's eager step with as many
        prompts as it holds (`graphs.prefill.StaticPrefillBuffers`), scaled by tokens."""
        buckets = sorted(set(buckets))
        if not buckets:
            return {}
        return scaled_peaks(self.profile_peak(buckets[-1], min(buckets[-1], self.max_seqs)), buckets)

    def capture_prefill_graphs(self, buckets: Iterable[int], max_seq_len: int, pool: Any = None) -> list[int]:
        """Capture a prefill graph per token bucket for steps of up to `max_num_seqs` prompts' rows (with fed
        rows beside them or not), into `pool` as `capture_graphs` does; returns the buckets captured. A
        Talker prompt's eager prefill took 42-69 ms on the H200 whatever its rows (benchmarks/RESULTS.md,
        "Where a loaded step's time goes"), most of a lone request's first packet."""
        buckets = sorted(set(buckets))
        if not buckets or (self.device.type == "cuda" and self.dtype != torch.bfloat16):
            return []
        buffers = StaticPrefillBuffers(
            buckets[-1], -(-max_seq_len // self.page_size), max_seq_len, self.cfg.hidden_size, self.dtype,
            self.device, max_seqs=min(self.max_seqs, buckets[-1]),
        )  # fmt: skip
        self.prefill_graphs = PrefillGraphs(self._prefill_step, buffers)
        with torch.inference_mode():
            return int_buckets(self.prefill_graphs.capture(buckets, pool=pool))

    @property
    def captured_buckets(self) -> list[int]:
        return int_buckets(self.graphs.captured_buckets) if self.graphs is not None else []

    def _prefill_step(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states `[S, H]` and masked logits `[S, V]` of the rows a prefill graph samples."""
        hidden = self.model(embeds, positions, self.kv_caches, meta).index_select(0, sample_rows)
        return hidden, self._logits(hidden)

    def _decode_step(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states `[B, H]` and masked logits `[B, V]` of B fed rows: what a decode graph holds."""
        hidden = self.model(embeds, positions, self.kv_caches, meta)
        return hidden, self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits with the suppressed ids at -inf (an index_fill: no host sync, graph safe)."""
        logits = self.model.compute_logits(hidden)
        if len(self.suppressed_ids):
            logits.index_fill_(1, self._suppressed, -torch.inf)
        return logits

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk[RowState]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states `[n, H]` and masked logits `[n, V]` (None when n is 0) of the n chunks that end
        in a sample, in chunk order; a decode step replays its bucket's graph when there is one."""
        embeds = torch.cat([c.seq.data.inputs(c.start, c.num_tokens) for c in chunks])
        decode = all(c.num_tokens == 1 and c.samples for c in chunks)
        meta = AttentionMetadata.build(
            [(c.start, c.num_tokens, c.seq.page_ids) for c in chunks], self.page_size, self.device
        )
        positions = self._positions(chunks, decode)
        if decode and self.graphs is not None and self.graphs.bucket_for(len(chunks)) is not None:
            hidden, logits = self.graphs.run(embeds, positions, meta)
            return hidden.clone(), logits  # the hidden states outlive the step; the logits do not
        ends = accumulate(c.num_tokens for c in chunks)  # a row that samples ends its chunk
        sampled = [end - 1 for end, c in zip(ends, chunks) if c.samples]
        rows = to_device(torch.tensor(sampled, dtype=torch.long), self.device)
        if self.prefill_graphs is not None:
            out = self.prefill_graphs.run(embeds, positions, meta, rows)
            if out is not None:
                hidden, logits = out
                return hidden[: len(sampled)].clone(), logits[: len(sampled)] if sampled else None
        hidden = self.model(embeds, positions, self.kv_caches, meta)
        if not decode:
            hidden = hidden.index_select(0, rows)
        return hidden, self._logits(hidden) if len(hidden) else None

    def _positions(self, chunks: list[ScheduledChunk[RowState]], decode: bool) -> torch.Tensor:
        """`[3, T]` M-RoPE positions on the device; a decode step's from host ints, in one copy."""
        if decode and all(c.start >= c.seq.num_prompt_tokens for c in chunks):
            rows = [c.start + c.seq.data.positions.delta for c in chunks]  # all three streams alike
            return to_device(torch.tensor(rows), self.device).expand(3, -1)
        positions = [positions_for(c.start, c.num_tokens, c.seq.data.positions) for c in chunks]
        return to_device(torch.cat(positions, dim=1), self.device)
