"""CUDA graphs for decode steps: one graph per batch bucket over static input buffers.

A decode batch of B sequences is padded to the smallest captured bucket: padding rows get input id 0,
position 0, slot -1 (write nothing), seq_len 0 (read nothing) and an all-zero block table, so they cost
a little compute and touch no real KV. Batches above the largest captured bucket, non-decode steps and
`enforce_eager` run the step eagerly. Off CUDA, `capture` binds eager calls over the same static buffers,
so the padding path is tested on the CPU; only the graph capture itself needs a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm import tqdm

from omnistage.engine.attention.metadata import AttentionMetadata
from omnistage.engine.capture_plan import bucket_for

logger = logging.getLogger(__name__)

StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Any]


class StaticDecodeBuffers:
    """Inputs of a decode step sized for the largest bucket; a bucket uses the first rows."""

    def __init__(
        self,
        max_batch: int,
        max_pages: int,
        max_seq_len: int,
        device: torch.device | str,
        position_rows: int = 3,
    ) -> None:
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.max_seq_len = max_seq_len
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
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

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the step is a decode step these buffers can hold (checked on host ints only)."""
        batch = input_ids.shape[0]
        return (
            meta.max_query_len == 1
            and meta.seq_lens.shape[0] == batch
            and meta.slot_mapping.shape[0] == batch
            and meta.block_tables.shape[1] <= self.max_pages
            and batch <= self.max_batch
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int
    ) -> None:
        """Copy a batch of B rows into rows [0, B) and pad rows [B, bucket); device copies, no sync."""
        batch, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.input_ids[batch:bucket].zero_()
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
        self.input_ids[:bucket].zero_()
        self.positions[:, :bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].zero_()
        self.block_tables[:bucket].zero_()


def _first_rows(out: Any, rows: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, tuple | list):
        return type(out)(_first_rows(o, rows) for o in out)
    return out


class DecodeGraphRunner:
    """Replays a captured graph per decode bucket; runs the step eagerly when no bucket fits.

    `step(input_ids [B], positions [3, B], meta) -> Tensor or tuple of Tensors` with B leading rows. The
    tensors `run` returns are views of the graph's static outputs: use them before the next `run`.
    """

    def __init__(
        self,
        step: StepFn,
        max_batch: int,
        max_pages: int,
        max_seq_len: int,
        device: torch.device | str,
        position_rows: int = 3,
        enforce_eager: bool = False,
    ) -> None:
        self.step = step
        self.device = torch.device(device)
        self.enforce_eager = enforce_eager
        self.buffers = StaticDecodeBuffers(max_batch, max_pages, max_seq_len, self.device, position_rows)
        self._replays: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, Any] = {}
        self._graphs: list[Any] = []
        self._pool = None
        self.graph_bytes: dict[int, int] = {}

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._replays)

    def bucket_for(self, batch: int) -> int | None:
        if self.enforce_eager:
            return None
        return bucket_for(batch, self._replays)

    def capture(self, buckets: Iterable[int]) -> list[int]:
        """Capture one graph per bucket, largest first so the smaller ones reuse its pool memory.

        Records the bytes each capture added to the reserved memory in `graph_bytes`; returns the buckets.
        """
        buckets = sorted(set(buckets), reverse=True)
        if self.enforce_eager or not buckets:
            return []
        if buckets[0] > self.buffers.max_batch:
            raise ValueError(f"bucket {buckets[0]} exceeds the static buffers' {self.buffers.max_batch} rows")
        start = time.perf_counter()
        if self.device.type != "cuda":
            for bucket in buckets:
                self._replays[bucket] = self._static_eager(bucket)
            return sorted(buckets)
        self._warm_up(buckets)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        for bucket in tqdm(buckets, desc="capturing decode graphs", unit="graph"):
            before = torch.cuda.memory_reserved(self.device)
            self.buffers.clear(bucket)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[bucket] = self.step(
                    self.buffers.input_ids[:bucket],
                    self.buffers.positions[:, :bucket],
                    self.buffers.meta(bucket),
                )
            self._graphs.append(graph)
            self._replays[bucket] = graph.replay
            self.graph_bytes[bucket] = torch.cuda.memory_reserved(self.device) - before
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        logger.info(
            "captured %d decode graphs (batch %d..%d) in %.1f s",
            len(buckets),
            buckets[-1],
            buckets[0],
            seconds,
        )
        return sorted(buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Any:
        """One decode step of B rows: replay the bucket's graph on padded inputs, or run eagerly."""
        batch = input_ids.shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None or not self.buffers.fits(input_ids, meta):
            return self.step(input_ids, positions, meta)
        self.buffers.fill(input_ids, positions, meta, bucket)
        self._replays[bucket]()
        return _first_rows(self._outputs[bucket], batch)

    def _static_eager(self, bucket: int) -> Callable[[], None]:
        def replay() -> None:
            b = self.buffers
            self._outputs[bucket] = self.step(b.input_ids[:bucket], b.positions[:, :bucket], b.meta(bucket))

        return replay

    def _warm_up(self, buckets: list[int]) -> None:
        # cuBLAS creates its handle and workspace, and Triton compiles a kernel per shape class, on first
        # use; graph capture cannot record either, so every bucket runs once on a side stream first.
        self.buffers.clear(max(buckets))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in buckets:
                self.step(self.buffers.input_ids[:b], self.buffers.positions[:, :b], self.buffers.meta(b))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
