"""CUDA graphs of steps with prompt rows: one graph per token bucket.

A step is one sequence's chunk (a prompt arriving while nothing else runs: the time to the first token at low
load), a burst of prompts prefilled together, or prompt chunks beside decode rows (a server under load admits
requests while others decode). The step's embeddings (encoder outputs already merged) are padded to the bucket
with rows that belong to no sequence (slot -1, no attention), its sequences to the bucket's slots with empty
ones, and the graph returns the logits of the rows it samples. Eagerly, a 100-token prefill of the released
Thinker spends ~45 ms launching ~13 ms of GPU work. Steps that fit no captured bucket (more rows, more
sequences, images' deepstack rows) run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.engine.graphs.base import GraphSet, StepFn
from omnistage.models.layers.attention_metadata import AttentionMetadata


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


class PrefillGraphs(GraphSet[StaticPrefillBuffers]):
    """Replays a captured graph per token bucket for a step of up to `max_seqs` sequences' chunks: prompt
    chunks, with decode rows beside them or not (a step that is all decode rows replays the decode graphs).

    `step(embeds [P, H], positions [3, P], meta, sample_rows [S]) -> logits [S, V]` of the sampled rows (or a
    tuple whose first item they are), S the bucket's sequence slots, on the device of `buffers`. `run` returns
    None when the step fits no captured bucket (the caller runs it eagerly); its result is a view of the graph's
    static output: use it before the next `run`.
    """

    kind = "prefill"
    unit = "tokens"

    def __init__(self, step: StepFn, buffers: StaticPrefillBuffers, enforce_eager: bool = False) -> None:
        super().__init__(step, buffers, buffers.embeds.device, enforce_eager)

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
        return self.replay(bucket, embeds, positions, meta, sample_rows)
