"""CUDA graphs for streamed Code2Wav: one per (chunk size, streams bucket) of `Code2Wav.decode_window`.

A streamer's decode call has shape `[streams, num_quantizers, left_context + chunk]` (a first chunk's
`[streams, num_quantizers, chunk]`: its stream's first frames alone), and a stream uses only two chunk sizes
(its first chunk, then the later ones), so a few graphs cover every call. Eagerly, a
call at the released sizes runs about 900 ATen ops (counted with a dispatch mode: 8 transformer layers,
then 4 decoder blocks of SnakeBeta, a transposed conv and three residual units), each a kernel launch of
several microseconds of host time, whatever the number of streams.

A call of n streams is padded to the smallest captured bucket with rows of zero codes starting at frame 0
(a window any stream could send: every value finite). `decode_window` never mixes rows (per-row
positions, attention masks and convolutions), so padding rows change no real row beyond the rounding of
kernels picked for a larger batch. Calls whose chunk size or stream count no graph fits run eagerly.

The waveform returned is a copy of the graph's static output: every graph of the set, and those of other
sets given the same `pool`, write into one memory pool, so a later replay of any of them may overwrite the
static output of another while the caller still slices and reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast

import torch
from torch import nn

from omnistage.engine.buckets import decode_buckets
from omnistage.engine.graphs.base import Bucket, GraphSet

GraphKey = tuple[int, int]  # (chunk frames, streams bucket)


class Quantizers(Protocol):
    @property
    def num_quantizers(self) -> int: ...


class WindowDecoder(Protocol):
    """A codec decoder's call shape (Qwen3-Omni's `Code2Wav` is one): the samples of windows of codes, each the
    `left_context` frames before a chunk and the chunk; its first parameter is on its device."""

    @property
    def config(self) -> Quantizers: ...
    @property
    def left_context(self) -> int: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def decode_window(self, codes: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor: ...


class WindowBuffers:
    """Decode windows of each chunk size for up to `capacity` streams; bucket (chunk, n) uses the first n
    rows of the chunk's windows."""

    def __init__(self, capacity: int, quantizers: int, windows: dict[int, int], device: torch.device) -> None:
        """`windows`: each chunk size's window, in frames."""
        self.capacity = capacity
        self.codes = {
            size: torch.zeros(capacity, quantizers, window, dtype=torch.long, device=device)
            for size, window in windows.items()
        }
        self.starts = {size: torch.zeros(capacity, dtype=torch.long, device=device) for size in windows}

    def args(self, bucket: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        size, streams = bucket
        return self.codes[size][:streams], self.starts[size][:streams]

    def fill(self, codes: torch.Tensor, starts: torch.Tensor, bucket: GraphKey) -> None:
        """Rows [0, n) the call's windows, rows [n, bucket) padding; device copies, no sync."""
        size, streams = bucket[0], codes.shape[0]
        self.codes[size][:streams].copy_(codes)
        self.starts[size][:streams].copy_(starts)
        self.clear(bucket, streams)

    def clear(self, bucket: GraphKey, start: int = 0) -> None:
        """Rows [start, bucket) padding: zero codes in a window at frame 0."""
        size, streams = bucket
        self.codes[size][start:streams].zero_()
        self.starts[size][start:streams].zero_()


class Code2WavGraphs(GraphSet[WindowBuffers]):
    """`decode_window` for chunks of `sizes` frames and up to `max_streams` streams, replayed from graphs.

    Called as `decode_window` is: `(codes [B, num_quantizers, left_context + n], starts [B]) -> [B, spf·n]`,
    and returns a tensor no later call overwrites. Before `capture` (or with `enforce_eager`) every call
    runs eagerly; off CUDA `capture` binds eager calls over the same static buffers and padding.
    """

    kind = "Code2Wav"
    unit = "streams"

    def __init__(
        self,
        model: WindowDecoder,
        sizes: Iterable[int],
        max_streams: int,
        enforce_eager: bool = False,
        prefix: int | None = None,
    ) -> None:
        """`prefix`: the one of `sizes` that is a stream's first chunk decoded from its first frames alone
        (`code2wav_streamer.decodes_first_as_prefix`): its windows hold the chunk only."""
        device = next(model.parameters()).device
        windows = {size: size if size == prefix else model.left_context + size for size in sorted(set(sizes))}
        buffers = WindowBuffers(max_streams, model.config.num_quantizers, windows, device)
        super().__init__(model.decode_window, buffers, device, enforce_eager)
        # every (chunk size, streams bucket) the set can capture
        self.buckets: list[GraphKey] = [(size, b) for size in windows for b in decode_buckets(max_streams)]
        self._sizes = {window: size for size, window in windows.items()}  # a call's chunk, by its window

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
    def __call__(self, codes: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        size = self._sizes.get(codes.shape[-1])
        bucket = self.bucket_for(codes.shape[0], (size,)) if size is not None else None
        if bucket is None:
            return self.step(codes, starts)
        return self.replay(bucket, codes, starts)[: codes.shape[0]].clone()
