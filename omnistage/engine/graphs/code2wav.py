"""CUDA graphs for streamed Code2Wav: one per (chunk size, streams bucket) of a chunk decoder's call.

A streamer's decode call has shape `[streams, num_quantizers, chunk]`, with each stream's start frame and
state slot, and a stream uses only two chunk sizes (its first chunk, then the later ones), so a few graphs
cover every call. Eagerly, a call at the released sizes runs about 900 ATen ops (counted with a dispatch
mode: 8 transformer layers, then 4 decoder blocks of SnakeBeta, a transposed conv and three residual units),
each a kernel launch of several microseconds of host time, whatever the number of streams.

A call of n streams is padded to the smallest captured bucket with rows of zero codes starting at frame 0 in
the scratch slot (a chunk any stream could send: every value finite, and no stream's state written). The
decode never mixes rows (per-row positions, attention masks, convolutions and slots), so padding rows change
no real row beyond the rounding of kernels picked for a larger batch. Calls whose chunk size or stream count
no graph fits run eagerly.

The waveform returned is a copy of the graph's static output: every graph of the set, and those of other
sets given the same `pool`, write into one memory pool, so a later replay of any of them may overwrite the
static output of another while the caller still slices and reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch

from omnistage.engine.buckets import decode_buckets
from omnistage.engine.graphs.base import Bucket, GraphSet

GraphKey = tuple[int, int]  # (chunk frames, streams bucket)


class ChunkDecode(Protocol):
    """A codec decoder's chunk call over per-stream state slots (Qwen3-Omni's `ChunkDecoder` is one):
    `(codes [B, num_quantizers, n], starts [B], slots [B]) -> [B, samples]`."""

    @property
    def num_quantizers(self) -> int: ...
    @property
    def scratch(self) -> int:
        """The slot padding rows write, which no stream holds."""
        ...

    @property
    def device(self) -> torch.device: ...
    def __call__(self, codes: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor: ...


class ChunkBuffers:
    """Decode calls of each chunk size for up to `capacity` streams; bucket (chunk, n) uses the first n rows of
    the chunk's buffers."""

    def __init__(
        self, capacity: int, quantizers: int, sizes: Iterable[int], scratch: int, device: torch.device
    ) -> None:
        self.capacity, self.scratch = capacity, scratch
        self.codes = {
            size: torch.zeros(capacity, quantizers, size, dtype=torch.long, device=device) for size in sizes
        }
        self.starts = {size: torch.zeros(capacity, dtype=torch.long, device=device) for size in self.codes}
        self.slots = {size: torch.full((capacity,), scratch, device=device) for size in self.codes}

    def args(self, bucket: GraphKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, streams = bucket
        return self.codes[size][:streams], self.starts[size][:streams], self.slots[size][:streams]

    def fill(self, codes: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, bucket: GraphKey) -> None:
        """Rows [0, n) the call's, rows [n, bucket) padding; device copies, no sync."""
        size, streams = bucket[0], codes.shape[0]
        self.codes[size][:streams].copy_(codes)
        self.starts[size][:streams].copy_(starts)
        self.slots[size][:streams].copy_(slots)
        self.clear(bucket, streams)

    def clear(self, bucket: GraphKey, start: int = 0) -> None:
        """Rows [start, bucket) padding: zero codes at frame 0 in the scratch slot."""
        size, streams = bucket
        self.codes[size][start:streams].zero_()
        self.starts[size][start:streams].zero_()
        self.slots[size][start:streams].fill_(self.scratch)


class Code2WavGraphs(GraphSet[ChunkBuffers]):
    """A chunk decoder's calls for chunks of `sizes` frames and up to `max_streams` streams, replayed from
    graphs.

    Called as the decoder is, and returns a tensor no later call overwrites. Before `capture` (or with
    `enforce_eager`) every call runs eagerly; off CUDA `capture` binds eager calls over the same static buffers
    and padding.
    """

    kind = "Code2Wav"
    unit = "streams"

    def __init__(
        self, decoder: ChunkDecode, sizes: Iterable[int], max_streams: int, enforce_eager: bool = False
    ) -> None:
        sizes = sorted(set(sizes))
        buffers = ChunkBuffers(max_streams, decoder.num_quantizers, sizes, decoder.scratch, decoder.device)
        super().__init__(decoder, buffers, decoder.device, enforce_eager)
        # every (chunk size, streams bucket) the set can capture
        self.buckets: list[GraphKey] = [(size, b) for size in sizes for b in decode_buckets(max_streams)]

    @torch.inference_mode()
    def capture(self, buckets: Iterable[Bucket] | None = None, pool: Any = None) -> list[Bucket]:
        """Capture `buckets` (default: all of them, `buckets`) into `pool` as GraphSet does; returns what is
        captured."""
        wanted = set(cast(Iterable[GraphKey], self.buckets if buckets is None else buckets))
        unknown = sorted(size for size, _ in wanted if size not in self.buffers.codes)
        if unknown:
            raise ValueError(f"no chunk size {unknown} in this set's {sorted(self.buffers.codes)}")
        super().capture(wanted, pool)
        return self.captured_buckets

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        size = codes.shape[-1]
        bucket = self.bucket_for(codes.shape[0], (size,)) if size in self.buffers.codes else None
        if bucket is None:
            return self.step(codes, starts, slots)
        return self.replay(bucket, codes, starts, slots)[: codes.shape[0]].clone()
