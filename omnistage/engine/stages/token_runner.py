"""Turns a scheduled step into tensors, runs the model over its paged KV, and returns the logits to sample.

The only place where scheduler bookkeeping meets tensors: flat token ids, 3-stream M-RoPE positions and
the attention metadata are built on the host from the chunks, moved to the device once, and the rows
that end a sampling chunk go through the LM head.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from omnistage.engine.attention import AttentionMetadata
from omnistage.engine.graphs import DecodeGraphs, PrefillGraphs
from omnistage.engine.graphs.prefill import StaticPrefillBuffers
from omnistage.engine.memory.measure import Peak, device_peak
from omnistage.engine.scheduler import ScheduledChunk, SchedulerOutput
from omnistage.engine.sequence import PromptInputs
from omnistage.engine.stages.decoder import (
    DecoderSizes,
    TokenDecoder,
    moe_routing,
    torch_module,
    warm_attention,
)
from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.layers.moe import kernel_switches
from omnistage.models.layers.rotary import PromptPositions

log = logging.getLogger(__name__)

P = TypeVar(
    "P", bound=PromptInputs
)  # a text stage's state of a request: what the runner reads of it, and more

# (tokens, sequences) of the eager steps run at start whatever the model: odd and even counts (Triton
# specialises integer arguments divisible by 16), one row and more (dynamo specialises 0 and 1), a step of
# several sequences; `warm_up_shapes` adds each MoE path's bounds and the largest step
WARM_UP_SHAPES = (
    (1, 1),
    (2, 1),
    (3, 1),
    (17, 1),
    (33, 1),
    (64, 1),
    (65, 1),
    (130, 1),
    (257, 1),
    (72, 8),
    (600, 1),
)


def warm_up_shapes(max_tokens: int, routing: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The eager step shapes a stage runs at start so that no step of up to `max_tokens` rows builds a kernel or
    a compiled variant while serving: WARM_UP_SHAPES, and for a MoE decoder (`routing`: its experts and those
    each token goes to, `decoder.moe_routing`; None: a dense one) the largest count of each kernel path and the
    one after it, then the largest step (a Talker prefill of 838 rows built a variant mid-serving on the H200
    when 600 was the largest warmed: benchmarks/RESULTS.md, "Builds while serving")."""
    tokens = [count for count, _ in WARM_UP_SHAPES]
    if routing is not None:
        tokens += [n for bound in kernel_switches(*routing) for n in (bound, bound + 1)]
    shapes = set(WARM_UP_SHAPES) | {(n, 1) for n in tokens} | {(max_tokens, 1)}
    return sorted(shape for shape in shapes if shape[0] <= max_tokens)


def rows_within(rows_host: np.ndarray, start: int, end: int) -> slice:
    """The share of ascending prompt rows that falls in [start, end), found on the host: a boolean mask of the
    device's copy would make the host wait for the device (a sync per chunk and kind of media in a step)."""
    return slice(int(np.searchsorted(rows_host, start)), int(np.searchsorted(rows_host, end)))


def positions_for(start: int, count: int, mrope: PromptPositions | None) -> torch.Tensor:
    """`[3, count]` positions of tokens start..start+count: text tokens share one position in all streams."""
    if mrope is None:
        return torch.arange(start, start + count).expand(3, count)
    end = start + count
    prompt_len = mrope.positions.shape[1]
    head = mrope.positions[:, start : min(end, prompt_len)]
    if end <= prompt_len:  # a prefill chunk inside the prompt
        return head
    tail = torch.arange(max(start, prompt_len), end).add(mrope.delta).expand(3, -1)
    return torch.cat([head, tail], dim=1)


@dataclass
class HiddenTap:
    """Hidden states a later stage reads: after `layer` layers, at prompt indices `rows` (`[n]`, on the device),
    written into `values` `[n, H]` as the prompt's chunks run (again, identically, after a preemption); the rows
    of pages found in the prefix cache are read from the runner's `tap_rows` instead."""

    layer: int
    rows: torch.Tensor  # ascending
    values: torch.Tensor
    rows_host: np.ndarray  # `rows` on the host
    num_filled: int = 0  # `values` holds every tapped row before this prompt index


class TokenRunner:
    """Owns the KV tensors of every layer and, on a GPU, the decode graphs."""

    def __init__(
        self,
        model: TokenDecoder,
        cfg: DecoderSizes,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        tap_layer: int | None = None,
        keep_taps: bool = False,
    ):
        """`tap_layer`: the layer every HiddenTap reads (StageModels.tap_layer), which the prefill graphs then
        also return; None: no tap, a prompt with one runs eagerly. `keep_taps` (with a `tap_layer`): every
        prefilled row's hidden state after it is kept beside its KV, in `tap_rows` `[pages, page_size, H]`,
        so that a prompt whose pages come from the prefix cache finds its tapped rows there."""
        self.model = model
        self.tap_layer = tap_layer
        self.keep_taps = keep_taps and tap_layer is not None
        self.tap_rows: torch.Tensor | None = None
        self.cfg = cfg
        self.page_size = page_size
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    @torch.inference_mode()
    def allocate_kv(self, num_pages: int) -> None:
        """KV tensors of every layer. Inference tensors always: the warm-up's scratch pages, the graphs'
        and the pool's then look alike to torch.compile's guards, so serving compiles nothing new."""
        shape = (2, num_pages, self.page_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.model.layers
        ]
        if self.keep_taps:
            rows = (num_pages, self.page_size, self.cfg.hidden_size)
            self.tap_rows = torch.zeros(rows, dtype=self.dtype, device=self.device)

    @property
    def tap_bytes_per_page(self) -> int:
        """What `tap_rows` adds to a KV page: one hidden row per token, or nothing without `keep_taps`."""
        return self.page_size * self.cfg.hidden_size * self.dtype.itemsize if self.keep_taps else 0

    def _decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def _prefill_logits(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The logits of the sampled rows, in the one buffer every prefill graph writes them to (a graph's own
        outputs stay in memory: [64 rows, 152,064] float32 is 39 MB a bucket at the released size), with every
        row's hidden states after `tap_layer` when set."""
        out = self.model(
            None, positions, self.kv_caches, meta, inputs_embeds=embeds, tap_layer=self.tap_layer
        )
        hidden, tapped = (out, None) if self.tap_layer is None else out
        logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        logits = self._prefill_logits_out[: logits.shape[0]].copy_(logits)
        return logits if tapped is None else (logits, tapped)

    def capture_graphs(
        self,
        buckets: list[int],
        max_model_len: int,
        enforce_eager: bool,
        prefill_buckets: Sequence[int] = (),
        prefill_pool: Any = None,
        max_seqs: int = 1,
    ) -> None:
        """Decode graphs for batch `buckets` in a memory pool of their own, and prefill graphs for token
        `prefill_buckets` of steps of up to `max_seqs` sequences in `prefill_pool` (the device's main-stream
        pool, `memory.plan.MAIN_POOL`; default: a new one); steps beyond them run eagerly."""
        max_pages = -(-max_model_len // self.page_size)
        if buckets:
            self.graphs = DecodeGraphs(
                self._decode_logits,
                max(buckets),
                max_pages,
                max_model_len,
                self.device,
                enforce_eager=enforce_eager,
            )
            with torch.inference_mode():
                self.graphs.capture(buckets)
        if prefill_buckets:
            slots = min(max_seqs, max(prefill_buckets))
            self._prefill_logits_out = torch.empty(
                slots, self.cfg.vocab_size, dtype=torch.float32, device=self.device
            )
            buffers = StaticPrefillBuffers(
                max(prefill_buckets), max_pages, max_model_len, self.cfg.hidden_size, self.dtype, self.device,
                max_seqs=slots,
            )  # fmt: skip
            self.prefill_graphs = PrefillGraphs(self._prefill_logits, buffers, enforce_eager)
            with torch.inference_mode():
                self.prefill_graphs.capture(prefill_buckets, pool=prefill_pool)

    @torch.inference_mode()
    def profile_peak(self, num_tokens: int, num_seqs: int) -> Peak:
        """Bytes the eager step of `num_seqs` sequences sharing `num_tokens` new tokens allocates at its peak,
        and what it keeps at its end (its hidden states and logits: a graph's outputs).

        Runs on scratch KV pages that are freed afterwards; the caller holds no KV yet.
        """
        per_seq = -(-num_tokens // num_seqs)
        pages_per_seq = -(-per_seq // self.page_size)
        self.allocate_kv(num_seqs * pages_per_seq)
        chunks = [
            (0, per_seq, list(range(i * pages_per_seq, (i + 1) * pages_per_seq))) for i in range(num_seqs)
        ]
        meta = AttentionMetadata.build(chunks, self.page_size, self.device)
        input_ids = torch.randint(0, self.cfg.vocab_size, (per_seq * num_seqs,), device=self.device)
        positions = torch.arange(per_seq, device=self.device).repeat(num_seqs).expand(3, -1)
        with device_peak(self.device) as peak:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
        self.kv_caches = []
        del hidden, logits
        torch.cuda.empty_cache()
        return peak

    def warm_up(self, max_tokens: int) -> None:
        """Run eager steps of the shapes traffic brings, so that Triton's per-shape-class kernel builds and
        torch.compile's graphs happen at start, not inside the first requests (measured: a 3 s TTFT at c=16)."""
        started = time.perf_counter()
        shapes = warm_up_shapes(max_tokens, moe_routing(self.cfg))
        for tokens, seqs in shapes:
            self.profile_peak(tokens, seqs)
        warm_attention(torch_module(self.model), self.dtype, self.device)
        log.info("warmed up %d step shapes in %.1f s", len(shapes), time.perf_counter() - started)

    def prepare(
        self, chunks: list[ScheduledChunk[P]], input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's token ids `[T]`, positions `[3, T]`, attention metadata and the rows whose logits are
        sampled (the last of each sampling chunk, in chunk order), built on the host and moved in one copy.
        `input_ids` (on the device) stand for the chunks' tokens when the host does not know them yet."""
        ids: list[int] = []
        positions = np.empty((3, sum(c.num_tokens for c in chunks)), dtype=np.int64)
        sample_rows: list[int] = []
        row = 0
        for chunk in chunks:
            start, count = chunk.start, chunk.num_tokens
            if input_ids is None:
                ids += chunk.seq.token_ids(start, start + count)
            mrope = chunk.seq.data.mrope
            if mrope is not None and start < mrope.positions.shape[1]:
                positions[:, row : row + count] = positions_for(start, count, mrope).numpy()
            else:  # text: one position in all three streams (numpy, not a tensor per chunk)
                first = start + (mrope.delta if mrope is not None else 0)
                positions[:, row : row + count] = np.arange(first, first + count)
            row += count
            if chunk.samples:
                sample_rows.append(row - 1)
        meta = AttentionMetadata.build(
            [(c.start, c.num_tokens, c.seq.page_ids) for c in chunks], self.page_size
        )
        meta, (host_ids, device_positions, device_rows) = meta.to_device(
            self.device,
            torch.from_numpy(np.array(ids, dtype=np.int64)),
            torch.from_numpy(positions),
            torch.from_numpy(np.array(sample_rows, dtype=np.int64)),
        )
        return (host_ids if input_ids is None else input_ids), device_positions, meta, device_rows

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput[P], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[n, vocab]` (float32) for the n chunks of `step` that end in a sample, in chunk order;
        `input_ids` as `prepare` takes them."""
        input_ids, positions, meta, sample_rows = self.prepare(step.chunks, input_ids)
        taps = [(i, tap) for i, c in enumerate(step.chunks) if (tap := _tap(c)) is not None]
        pure_decode = step.is_pure_decode
        if self.graphs is not None and pure_decode and self.graphs.bucket_for(len(step.chunks)) is not None:
            return self.graphs.run(input_ids, positions, meta)
        for i, tap in taps:
            self._read_cached_taps(tap, step.chunks[i])
        keep = self.tap_rows is not None and not pure_decode
        embeds, deepstack = self._merge_multimodal(step.chunks, input_ids)
        starts = np.cumsum([0] + [c.num_tokens for c in step.chunks]).tolist()  # each chunk's first row
        graph_taps = all(tap.layer == self.tap_layer for _, tap in taps)
        if self.prefill_graphs is not None and deepstack is None and graph_taps:
            rows = embeds if embeds is not None else self.model.model.embed_tokens(input_ids)
            out = self.prefill_graphs.run(rows, positions, meta, sample_rows)
            if out is not None:
                logits = out if self.tap_layer is None else out[0]
                for i, tap in taps:
                    _write_tap(tap, step.chunks[i], out[1][starts[i] :])
                if keep:
                    self._keep_taps(meta, out[1])
                return logits[: sample_rows.shape[0]]
        tap_layer = taps[0][1].layer if taps else (self.tap_layer if keep else None)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, embeds, deepstack, tap_layer)
        if tap_layer is not None:
            hidden, tapped = hidden
            for i, tap in taps:
                _write_tap(tap, step.chunks[i], tapped[starts[i] :])
            if keep and tap_layer == self.tap_layer:
                self._keep_taps(meta, tapped)
        # a decode step samples every row, in order
        return self.model.compute_logits(hidden if pure_decode else hidden.index_select(0, sample_rows))

    def _keep_taps(self, meta: AttentionMetadata, tapped: torch.Tensor) -> None:
        """Every row of the step's hidden states after `tap_layer` into its KV slot's place in `tap_rows`: a
        page is entered into the prefix cache once computed, and whichever prompt takes it later may tap any
        of its rows. A slot of a page another sequence shares is never written (only new pages are computed)."""
        assert self.tap_rows is not None
        slots = meta.slot_mapping
        flat = self.tap_rows.view(-1, self.tap_rows.shape[-1])
        flat.index_copy_(0, slots, tapped[: slots.shape[0]].to(flat.dtype))

    def _read_cached_taps(self, tap: HiddenTap, chunk: ScheduledChunk[P]) -> None:
        """The tapped rows before `chunk` that no chunk computed (pages taken from the prefix cache at
        admission) from `tap_rows`, where the chunk that computed those pages left them."""
        if tap.num_filled >= chunk.start:
            return
        if self.tap_rows is None or tap.layer != self.tap_layer:
            raise RuntimeError(
                f"{chunk.seq.request_id}: tapped rows before {chunk.start} were never computed"
            )
        inside = rows_within(tap.rows_host, tap.num_filled, chunk.start)
        rows = tap.rows_host[inside]
        pages = np.asarray(chunk.seq.page_ids, dtype=np.int64)[rows // self.page_size]
        slots = to_device(torch.from_numpy(pages * self.page_size + rows % self.page_size), self.device)
        flat = self.tap_rows.view(-1, self.tap_rows.shape[-1])
        tap.values[inside] = flat.index_select(0, slots).to(tap.values.dtype)
        tap.num_filled = chunk.start

    def _merge_multimodal(
        self, chunks: list[ScheduledChunk[P]], input_ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """Token embeddings with encoder outputs at the placeholder rows the chunks cover, and deepstack."""
        if not any(c.seq.data.mm is not None for c in chunks):
            return None, None
        embeds = self.model.model.embed_tokens(input_ids)
        deepstack = None
        offset = 0
        for chunk in chunks:
            mm = chunk.seq.data.mm
            if mm is not None and chunk.start < chunk.seq.num_prompt_tokens:
                end = chunk.start + chunk.num_tokens
                media = (
                    (mm.audio_rows, mm.audio_rows_host, mm.audio_embeds),
                    (mm.image_rows, mm.image_rows_host, mm.image_embeds),
                )
                for rows, host, values in media:
                    if values is None:
                        continue
                    inside = rows_within(host, chunk.start, end)
                    embeds[offset + rows[inside] - chunk.start] = values[inside].to(embeds.dtype)
                if mm.deepstack is not None:
                    inside = rows_within(mm.image_rows_host, chunk.start, end)
                    if deepstack is None:
                        deepstack = [torch.zeros_like(embeds) for _ in range(mm.deepstack.shape[0])]
                    for level, target in enumerate(deepstack):
                        target[offset + mm.image_rows[inside] - chunk.start] = mm.deepstack[level][inside].to(
                            embeds.dtype
                        )
            offset += chunk.num_tokens
        return embeds, deepstack


def _write_tap(tap: HiddenTap, chunk: ScheduledChunk[P], tapped: torch.Tensor) -> None:
    """The tap's rows inside `chunk` from `tapped`, the chunk's hidden states from its first row on."""
    end = chunk.start + chunk.num_tokens
    inside = rows_within(tap.rows_host, chunk.start, end)
    tap.values[inside] = tapped[tap.rows[inside] - chunk.start].to(tap.values.dtype)
    tap.num_filled = max(tap.num_filled, end)


def _tap(chunk: ScheduledChunk[P]) -> HiddenTap | None:
    """The chunk's tap while it runs prompt rows."""
    tap = chunk.seq.data.tap
    return tap if tap is not None and chunk.start < chunk.seq.num_prompt_tokens else None
