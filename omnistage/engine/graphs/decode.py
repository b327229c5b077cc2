"""CUDA graphs of decode steps: one graph per batch bucket.

A decode batch of B sequences is padded to the smallest captured bucket: padding rows get input 0 (token id 0,
or a zero embedding for a stage fed embeddings), position 0, slot -1 (write nothing), seq_len 0 (read nothing)
and an all-zero block table, so they cost a little compute and touch no real KV. Batches past the largest
bucket, and `enforce_eager`, run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.engine.graphs.base import GraphSet, StepFn
from omnistage.models.layers.attention_metadata import AttentionMetadata


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


def _first_rows(out: Any, rows: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, tuple | list):
        return type(out)(_first_rows(o, rows) for o in out)
    return out


class DecodeGraphs(GraphSet[StaticDecodeBuffers]):
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
        return _first_rows(self.replay(bucket, inputs, positions, meta), batch)
