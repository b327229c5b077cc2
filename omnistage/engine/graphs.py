"""CUDA graphs for the steps whose host work outweighs their GPU work: decode batches and short prefills.

Decode: one graph per batch bucket. A decode batch of B sequences is padded to the smallest captured
bucket: padding rows get input 0 (token id 0, or a zero embedding for a stage fed embeddings), position 0,
slot -1 (write nothing), seq_len 0 (read nothing) and an all-zero block table, so they cost a little
compute and touch no real KV.

Prefill: one graph per token bucket for a step with prompt rows: one sequence's chunk (a prompt arriving
while nothing else runs: the time to the first token at low load), a burst of prompts prefilled together,
or prompt chunks beside decode rows (a server under load admits requests while others decode). The step's
embeddings (encoder outputs already merged) are padded to the bucket with rows that belong to no sequence
(slot -1, no attention), its sequences to the bucket's slots with empty ones, and the graph returns the
logits of the rows it samples. Eagerly, a 100-token prefill of the released Thinker spends ~45 ms
launching ~13 ms of GPU work.

Steps that fit no captured bucket (more rows, more sequences, images' deepstack rows) and `enforce_eager`
run eagerly. Off CUDA, `capture` binds
eager calls over the same static buffers, so the padding paths are tested on the CPU; only the graph
capture itself needs a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm import tqdm

from omnistage.engine.buckets import bucket_for, faster_buckets
from omnistage.models.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

TIMED_REPLAYS = 5  # per bucket, after one untimed, when a set routes batches by measured speed

StepFn = Callable[..., Any]


class StaticDecodeBuffers:
    """Inputs of a decode step sized for the largest bucket; a bucket uses the first rows.

    A row's input is a token id (`row_shape` (), int64: the Thinker) or a whole row of `row_shape`, such as
    an embedding `(H,)` in the model's dtype (the Talker, whose input rows are built outside it).
    """

    def __init__(
        self,
        max_batch: int,
        max_pages: int,
        max_seq_len: int,
        device: torch.device | str,
        position_rows: int = 3,
        row_shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.long,
    ) -> None:
        self.max_batch = self.capacity = max_batch
        self.max_pages = max_pages
        self.max_seq_len = max_seq_len
        self.inputs = torch.zeros(max_batch, *row_shape, dtype=dtype, device=device)
        self.positions = torch.zeros(position_rows, max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        # One new token per sequence: row b is sequence b, padding sequences included.
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)

    def meta(self, bucket: int) -> AttentionMetadata:
        """The metadata a graph of `bucket` rows is captured with: views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def args(self, bucket: int) -> tuple:
        """The step's arguments for a graph of `bucket` rows."""
        return self.inputs[:bucket], self.positions[:, :bucket], self.meta(bucket)

    def fits(self, inputs: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the step is a decode step these buffers can hold (checked on host ints only)."""
        batch = inputs.shape[0]
        return (
            meta.max_query_len == 1
            and meta.seq_lens.shape[0] == batch
            and meta.slot_mapping.shape[0] == batch
            and meta.block_tables.shape[1] <= self.max_pages
            and batch <= self.max_batch
        )

    def fill(
        self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int
    ) -> None:
        """Copy a batch of B rows into rows [0, B) and pad rows [B, bucket); device copies, no sync."""
        batch, width = inputs.shape[0], meta.block_tables.shape[1]
        self.inputs[:batch].copy_(inputs)
        self.inputs[batch:bucket].zero_()
        self.positions[:, :batch].copy_(positions)
        self.positions[:, batch:bucket].zero_()
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:bucket].zero_()
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self.block_tables[:batch, width:].zero_()
        self.block_tables[batch:bucket].zero_()

    def clear(self, bucket: int) -> None:
        """Make rows [0, bucket) padding (used before warm-up and capture: nothing is written to KV)."""
        self.inputs[:bucket].zero_()
        self.positions[:, :bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].zero_()
        self.block_tables[:bucket].zero_()


class StaticPrefillBuffers:
    """Inputs of a step of up to `max_seqs` sequences' chunks (prompt chunks, decode rows beside them) sized for
    the largest token bucket; a bucket of P tokens uses the first P rows and min(P, max_seqs) sequence slots (a
    step of P rows has at most P chunks). Rows past the step's belong to no sequence (slot -1, outside
    query_start_loc); slots past its sequences are empty ones (no rows, seq_len 0); `sample_rows` names the
    rows whose logits are sampled, padded with row 0."""

    def __init__(
        self,
        max_tokens: int,
        max_pages: int,
        max_seq_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        position_rows: int = 3,
        max_seqs: int = 1,
    ) -> None:
        self.max_tokens = self.capacity = max_tokens
        self.max_seqs = max_seqs
        self.max_pages = max_pages
        self.max_seq_len = max_seq_len
        self.embeds = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(position_rows, max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_pages, dtype=torch.int32, device=device)
        self.sample_rows = torch.zeros(max_seqs, dtype=torch.long, device=device)

    def slots(self, bucket: int) -> int:
        """The sequence slots of a bucket of `bucket` tokens."""
        return min(self.max_seqs, bucket)

    def meta(self, bucket: int) -> AttentionMetadata:
        slots = self.slots(bucket)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: slots + 1],
            seq_lens=self.seq_lens[:slots],
            block_tables=self.block_tables[:slots],
            max_query_len=bucket,
            max_seq_len=self.max_seq_len,
        )

    def args(self, bucket: int) -> tuple:
        return (
            self.embeds[:bucket],
            self.positions[:, :bucket],
            self.meta(bucket),
            self.sample_rows[: self.slots(bucket)],
        )

    def fits(self, embeds: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the step is one these buffers can hold (host ints only)."""
        return (
            1 <= meta.seq_lens.shape[0] <= self.max_seqs
            and meta.slot_mapping.shape[0] == embeds.shape[0]
            and meta.block_tables.shape[1] <= self.max_pages
            and 1 <= embeds.shape[0] <= self.max_tokens
        )

    def fill(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
        bucket: int,
    ) -> None:
        """Copy a step of T rows of n sequences into rows [0, T) and slots [0, n), pad the rest of the bucket;
        device copies, no sync."""
        tokens, seqs, width = embeds.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1]
        slots, samples = self.slots(bucket), sample_rows.shape[0]
        self.embeds[:tokens].copy_(embeds)
        self.embeds[tokens:bucket].zero_()
        self.positions[:, :tokens].copy_(positions)
        self.positions[:, tokens:bucket].zero_()
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        self.slot_mapping[tokens:bucket].fill_(-1)
        self.query_start_loc[: seqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[seqs + 1 : slots + 1].fill_(tokens)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        self.seq_lens[seqs:slots].zero_()
        self.block_tables[:seqs, :width].copy_(meta.block_tables)
        self.block_tables[:seqs, width:].zero_()
        self.block_tables[seqs:slots].zero_()
        self.sample_rows[:samples].copy_(sample_rows)
        self.sample_rows[samples:slots].zero_()

    def clear(self, bucket: int) -> None:
        """A step of no tokens (used before warm-up and capture: nothing is written to KV)."""
        slots = self.slots(bucket)
        self.embeds[:bucket].zero_()
        self.positions[:, :bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.query_start_loc[: slots + 1].zero_()
        self.seq_lens[:slots].zero_()
        self.block_tables[:slots].zero_()
        self.sample_rows[:slots].zero_()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every graph set of `device` captures on. Not torch.cuda.graph's default, which is made once
    per process on the device current at the first capture: with stages on two GPUs a set on the other one
    would capture on a foreign stream (its kernels then not captured, its allocations refused). One stream for
    all the sets of a device, as the caching allocator gives a pool's freed blocks only to allocations on the
    stream that freed them: the sets sharing a pool share their scratch only if captured on one stream."""
    return _capture_stream(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capture_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


def _first_rows(out: Any, rows: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, tuple | list):
        return type(out)(_first_rows(o, rows) for o in out)
    return out


class GraphSet:
    """One captured graph per bucket of a step function over static buffers (`buffers.args(bucket)`).

    Graphs are captured largest first into one memory pool, which the smaller ones (and other sets given
    the same `pool`) reuse: only one step runs at a time. A set with `route_by_speed` times each bucket's
    replay after capture and sends a batch to a larger bucket whose graph replays faster
    (`buckets.faster_buckets`); `routes` holds what it chose.
    """

    kind = "step"
    unit = "rows"
    route_by_speed = False

    def __init__(self, step: StepFn, buffers: Any, device: torch.device | str, enforce_eager: bool = False):
        self.step = step
        self.buffers = buffers
        self.device = torch.device(device)
        self.enforce_eager = enforce_eager
        self._replays: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, Any] = {}
        self._graphs: list[Any] = []
        self.pool: Any = None  # a CUDA graph pool handle, once captured
        self.graph_bytes: dict[int, int] = {}
        self.replay_ms: dict[int, float] = {}
        self.routes: dict[int, int] = {}

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._replays)

    def bucket_for(self, size: int) -> int | None:
        if self.enforce_eager:
            return None
        bucket = bucket_for(size, self._replays)
        return self.routes.get(bucket, bucket) if bucket is not None else None

    def routes_note(self) -> str:
        """The routes that pad to a larger bucket, for the start-up summary ("" when none does)."""
        moved = [(b, r) for b, r in sorted(self.routes.items()) if r != b]
        if not moved:
            return ""
        return " (" + ", ".join(f"{b} replays {r}" for b, r in moved) + ": measured faster)"

    def capture(self, buckets: Iterable[int], pool: Any = None) -> list[int]:
        """Capture one graph per bucket, largest first; records each capture's added bytes in `graph_bytes`."""
        buckets = sorted(set(buckets), reverse=True)
        if self.enforce_eager or not buckets:
            return []
        if buckets[0] > self.buffers.capacity:
            raise ValueError(
                f"bucket {buckets[0]} exceeds the static buffers' {self.buffers.capacity} {self.unit}"
            )
        start = time.perf_counter()
        if self.device.type != "cuda":
            for bucket in buckets:
                self._replays[bucket] = self._static_eager(bucket)
            return sorted(buckets)
        self._warm_up(buckets)
        self.pool = pool or self.pool or torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        for bucket in tqdm(buckets, desc=f"capturing {self.kind} graphs", unit="graph"):
            # what torch.cuda.graph does on entering; done before measuring, the cached blocks it frees (the
            # warm-up's) are not taken off what the capture adds
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
            self.buffers.clear(bucket)
            graph = torch.cuda.CUDAGraph()
            # capturing on `stream` also makes its device the current one
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._outputs[bucket] = self.step(*self.buffers.args(bucket))
            self._graphs.append(graph)
            self._replays[bucket] = graph.replay
            self.graph_bytes[bucket] = torch.cuda.memory_reserved(self.device) - before
        torch.cuda.synchronize(self.device)
        if self.route_by_speed:
            with torch.cuda.device(self.device):  # the events' stream: the one the graphs replay on
                self.replay_ms = self._time_replays(buckets)
            self.routes = faster_buckets(self.replay_ms)
        logger.info(
            "captured %d %s graphs (%s %d..%d) in %.1f s%s",
            len(buckets), self.kind, self.unit, buckets[-1], buckets[0], time.perf_counter() - start,
            self.routes_note(),
        )  # fmt: skip
        return sorted(buckets)

    def _time_replays(self, buckets: list[int]) -> dict[int, float]:
        """Milliseconds of one replay per bucket, over padding rows (as captured: they touch no state)."""
        times = {}
        for bucket in buckets:
            self.buffers.clear(bucket)
            replay = self._replays[bucket]
            replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(TIMED_REPLAYS):
                replay()
            end.record()
            end.synchronize()
            times[bucket] = start.elapsed_time(end) / TIMED_REPLAYS
        return times

    def _static_eager(self, bucket: int) -> Callable[[], None]:
        def replay() -> None:
            self._outputs[bucket] = self.step(*self.buffers.args(bucket))

        return replay

    def _warm_up(self, buckets: list[int]) -> None:
        # cuBLAS creates its handle and workspace, and Triton compiles a kernel per shape class, on first
        # use; graph capture cannot record either, so every bucket runs once on a side stream first.
        self.buffers.clear(max(buckets))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in buckets:
                self.step(*self.buffers.args(b))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)


class DecodeGraphRunner(GraphSet):
    """Replays a captured graph per decode bucket; runs the step eagerly when no bucket fits.

    `step(inputs, positions [3, B], meta) -> Tensor or tuple of Tensors` with B leading rows, where inputs
    are ids `[B]` or rows `[B, *row_shape]`. The tensors `run` returns are views of the graph's static
    outputs: use them before the next `run`.
    """

    kind = "decode"
    unit = "batch"
    route_by_speed = True

    def __init__(
        self,
        step: StepFn,
        max_batch: int,
        max_pages: int,
        max_seq_len: int,
        device: torch.device | str,
        position_rows: int = 3,
        enforce_eager: bool = False,
        row_shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.long,
    ) -> None:
        buffers = StaticDecodeBuffers(
            max_batch, max_pages, max_seq_len, device, position_rows, row_shape, dtype
        )
        super().__init__(step, buffers, device, enforce_eager)

    def run(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Any:
        """One decode step of B rows: replay the bucket's graph on padded inputs, or run eagerly."""
        batch = inputs.shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None or not self.buffers.fits(inputs, meta):
            return self.step(inputs, positions, meta)
        self.buffers.fill(inputs, positions, meta, bucket)
        self._replays[bucket]()
        return _first_rows(self._outputs[bucket], batch)


class PrefillGraphRunner(GraphSet):
    """Replays a captured graph per token bucket for a step of up to `max_seqs` sequences' chunks: prompt
    chunks, with decode rows beside them or not (a step that is all decode rows replays the decode graphs).

    `step(embeds [P, H], positions [3, P], meta, sample_rows [S]) -> logits [S, V]` of the sampled rows (or a
    tuple whose first item they are), S the bucket's sequence slots. `run` returns None when the step fits no
    captured bucket (the caller runs it eagerly); its result is a view of the graph's static output: use it
    before the next `run`.
    """

    kind = "prefill"
    unit = "tokens"

    def __init__(
        self,
        step: StepFn,
        max_tokens: int,
        max_pages: int,
        max_seq_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        position_rows: int = 3,
        enforce_eager: bool = False,
        max_seqs: int = 1,
    ) -> None:
        buffers = StaticPrefillBuffers(
            max_tokens, max_pages, max_seq_len, hidden_size, dtype, device, position_rows, max_seqs
        )
        super().__init__(step, buffers, device, enforce_eager)

    def run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> Any:
        bucket = self.bucket_for(embeds.shape[0]) if embeds.shape[0] else None
        if bucket is None or not self.buffers.fits(embeds, meta):
            return None
        self.buffers.fill(embeds, positions, meta, sample_rows, bucket)
        self._replays[bucket]()
        return self._outputs[bucket]
