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

from collections.abc import Iterable
from typing import Any

import torch

from omnistage.engine.buckets import decode_buckets
from omnistage.engine.gpu_memory import Peak, device_peak, scaled_peaks
from omnistage.engine.graphs import GraphSet
from omnistage.models.qwen3_omni.code2wav import Code2Wav

GraphKey = tuple[int, int]  # (chunk frames, streams bucket)


class _WindowBuffers:
    """Decode windows of one chunk size for up to `capacity` streams; a bucket uses the first rows."""

    def __init__(self, capacity: int, quantizers: int, window: int, device: torch.device) -> None:
        self.capacity = capacity
        self.codes = torch.zeros(capacity, quantizers, window, dtype=torch.long, device=device)
        self.starts = torch.zeros(capacity, dtype=torch.long, device=device)

    def args(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes[:bucket], self.starts[:bucket]

    def fill(self, codes: torch.Tensor, starts: torch.Tensor, bucket: int) -> None:
        """Rows [0, n) the call's windows, rows [n, bucket) padding; device copies, no sync."""
        streams = codes.shape[0]
        self.codes[:streams].copy_(codes)
        self.starts[:streams].copy_(starts)
        self.clear(bucket, streams)

    def clear(self, bucket: int, start: int = 0) -> None:
        """Rows [start, bucket) padding: zero codes in a window at frame 0."""
        self.codes[start:bucket].zero_()
        self.starts[start:bucket].zero_()


class _ChunkGraphs(GraphSet):
    """The graphs of one chunk size, one per streams bucket."""

    unit = "streams"

    def __init__(
        self, model: Code2Wav, size: int, max_streams: int, enforce_eager: bool, window: int
    ) -> None:
        device = model.code_embedding.weight.device
        buffers = _WindowBuffers(max_streams, model.config.num_quantizers, window, device)
        super().__init__(model.decode_window, buffers, device, enforce_eager)
        self.kind = f"Code2Wav {size}-frame chunk"

    def run(self, codes: torch.Tensor, starts: torch.Tensor) -> torch.Tensor | None:
        """The waveform of the call (a copy), or None when no captured bucket holds its streams."""
        streams = codes.shape[0]
        bucket = self.bucket_for(streams)
        if bucket is None:
            return None
        self.buffers.fill(codes, starts, bucket)
        self._replays[bucket]()
        return self._outputs[bucket][:streams].clone()


class Code2WavGraphs:
    """`decode_window` for chunks of `sizes` frames and up to `max_streams` streams, replayed from graphs.

    Called as `decode_window` is: `(codes [B, num_quantizers, left_context + n], starts [B]) -> [B, spf·n]`,
    and returns a tensor no later call overwrites. Before `capture` (or with `enforce_eager`) every call
    runs eagerly; off CUDA `capture` binds eager calls over the same static buffers and padding.
    """

    def __init__(
        self,
        model: Code2Wav,
        sizes: Iterable[int],
        max_streams: int,
        enforce_eager: bool = False,
        prefix: int | None = None,
    ) -> None:
        """`prefix`: the one of `sizes` that is a stream's first chunk decoded from its first frames alone
        (`code2wav_streamer.decodes_first_as_prefix`): its windows hold the chunk only."""
        self.model = model
        self.device = model.code_embedding.weight.device
        self.enforce_eager = enforce_eager
        self.buckets = decode_buckets(max_streams)
        # largest chunk first: its graphs take the most memory, which the smaller ones then reuse
        self.sets = {
            size: _ChunkGraphs(
                model, size, max_streams, enforce_eager, size if size == prefix else model.left_context + size
            )
            for size in sorted(set(sizes), reverse=True)
        }
        self._by_window = {graphs.buffers.codes.shape[-1]: graphs for graphs in self.sets.values()}
        self.pool = None

    @property
    def graphs(self) -> list[GraphKey]:
        """Every (chunk size, streams bucket) this runner can capture."""
        return [(size, bucket) for size in sorted(self.sets) for bucket in self.buckets]

    @property
    def captured(self) -> list[GraphKey]:
        return [(size, b) for size in sorted(self.sets) for b in self.sets[size].captured_buckets]

    @property
    def graph_bytes(self) -> dict[GraphKey, int]:
        """Pool bytes each captured graph added (CUDA only)."""
        return {(size, b): n for size, graphs in self.sets.items() for b, n in graphs.graph_bytes.items()}

    @torch.inference_mode()
    def graph_costs(self) -> dict[GraphKey, Peak]:
        """Graph memory per (chunk size, bucket) for the planner: each chunk size's measured eager call at the
        largest bucket, scaled by streams as the LLM stages' graphs are (`scaled_peaks`), and what the call
        keeps (its waveform; the rest, the convolutions' activations over the whole window, is scratch that
        the graphs of one pool share). Off CUDA or eager nothing is captured, so nothing is priced."""
        if self.device.type != "cuda" or self.enforce_eager:
            return {}
        costs: dict[GraphKey, Peak] = {}
        for size, graphs in self.sets.items():
            codes, starts = graphs.buffers.args(max(self.buckets))
            with device_peak(self.device) as peak:
                out = self.model.decode_window(codes, starts)
            del out
            torch.cuda.empty_cache()
            costs |= {(size, b): scaled for b, scaled in scaled_peaks(peak, self.buckets).items()}
        return costs

    @torch.inference_mode()
    def capture(self, graphs: Iterable[GraphKey] | None = None, pool: Any = None) -> list[GraphKey]:
        """Capture `graphs` (default: all of them) into `pool` (default: a new one, then `self.pool`);
        returns what is captured."""
        wanted = set(self.graphs if graphs is None else graphs)
        unknown = sorted(size for size, _ in wanted if size not in self.sets)
        if unknown:
            raise ValueError(f"no chunk size {unknown} in this runner's {sorted(self.sets)}")
        self.pool = pool or self.pool
        for size, chunk_graphs in self.sets.items():
            chunk_graphs.capture([b for s, b in wanted if s == size], pool=self.pool)
            self.pool = self.pool or chunk_graphs.pool
        return self.captured

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        chunk_graphs = self._by_window.get(codes.shape[-1])
        wav = chunk_graphs.run(codes, starts) if chunk_graphs is not None else None
        return self.model.decode_window(codes, starts) if wav is None else wav
