"""Streaming Code2Wav: many streams of codec frames decoded chunk by chunk in batched calls, each stream's
chunks together equal to its one-shot decode (see `Code2Wav.decode_window` for the window arithmetic).

Chunk sizes: a first chunk of 2 frames, then 25. Every later chunk's decode call runs the transformer over
`left_context` frames before the chunk and the convolutions over `decoder_context` frames before it
(released: 578 and 10), whatever the chunk's size. Counted with torch's FLOP counter at the released sizes, a
call of one stream costs 185 GFLOP of context plus about 5.2 per chunk frame: 190 for 1 frame, 195 for 2,
313 for 25. A first chunk has nothing before it: its call decodes the stream's first frames alone, as a
one-shot prefix (`Code2Wav.decode_window`), ~10 GFLOP for 2 frames instead of 195 (a call of 16 streams'
first chunks took 21-30 ms on the H200 with the context, benchmarks/RESULTS.md "Where a loaded step's time
goes": four of them at c=64 before every stream had its first packet).
- First chunk, 2 frames (the first packet's latency): the second frame costs one more Talker and
  code-predictor step. In return the first packet holds more than twice the audio, because the decoder's
  look-ahead (555 samples, 29% of a frame) comes off a stream's first chunk only: 1 frame gives 1,365
  samples (57 ms), 2 give 3,285 (137 ms), which play while the next 25 frames are generated.
- Later chunks, 25 frames (throughput): the fixed context work is 59% of a 25-frame call (75% at 12
  frames, 42% at 50). Larger chunks would save less per frame than they delay every packet after the first
  and grow a call's activations (streams × window frames).
Two sizes also mean two shapes per streams bucket to capture as CUDA graphs (`engine/graphs/code2wav.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.qwen3_omni.code2wav import Code2Wav

DecodeWindow = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def decodes_first_as_prefix(model: Code2Wav, first_chunk: int, chunk: int) -> bool:
    """Whether a stream's first chunk is decoded from its first frames alone (a window without the context
    every later chunk carries): where the first chunk has a size of its own, shorter than the context."""
    return first_chunk != chunk and first_chunk <= model.left_context


@dataclass(frozen=True)
class AudioChunk:
    request_id: Hashable
    samples: torch.Tensor  # [n] at 24 kHz, the model's dtype
    final: bool  # the stream is finished and this is its last chunk


@dataclass
class _Stream:
    codes: torch.Tensor  # [num_quantizers, kept]: the left context of the next chunk, then undecoded frames
    first: int = 0  # stream index of codes[:, 0]
    decoded: int = 0  # frames whose samples were emitted
    finished: bool = False

    @property
    def frames(self) -> int:
        return self.first + self.codes.shape[1]


class Code2WavStreamer:
    """Decodes many streams of codec frames chunk by chunk, batched; the chunks of a stream, concatenated,
    are its one-shot decode.

    A stream's first chunk holds `first_chunk` frames (small: the first packet's latency), later ones `chunk`,
    the last one what remains at `finish` (right-padded; no emitted sample reads past the stream's last
    frame). One decode call holds at most `max_batch` streams. Each chunk is decoded in a window of the
    model's fixed `left_context` earlier frames plus the chunk (a first chunk of its own size in its frames
    alone, `decodes_first_as_prefix`), so a call's shapes depend only on (streams, chunk size).

    `decode` runs each call as `Code2Wav.decode_window` does (a CUDA graph runner, say); None calls the
    model's own, looked up per call (so a wrapper set on the model later is the one called). Its result must be a tensor no later call overwrites: the chunks of
    one `step` are views of its results, read after the step's last call.
    """

    def __init__(
        self,
        model: Code2Wav,
        first_chunk: int = 2,
        chunk: int = 25,
        max_batch: int = 16,
        decode: DecodeWindow | None = None,
    ) -> None:
        if min(first_chunk, chunk, max_batch) < 1:
            raise ValueError(
                f"chunk sizes and max_batch must be positive, got first_chunk={first_chunk}, chunk={chunk}, "
                f"max_batch={max_batch}"
            )
        self.model, self.first_chunk, self.chunk, self.max_batch = model, first_chunk, chunk, max_batch
        self.prefix_first = decodes_first_as_prefix(model, first_chunk, chunk)
        self.decode = decode
        self.device, self.dtype = model.code_embedding.weight.device, model.code_embedding.weight.dtype
        self.streams: dict[Hashable, _Stream] = {}

    def open(self, request_id: Hashable) -> None:
        if request_id in self.streams:
            raise ValueError(f"stream {request_id!r} is already open")
        quantizers = self.model.config.num_quantizers
        self.streams[request_id] = _Stream(torch.zeros(quantizers, 0, dtype=torch.long, device=self.device))

    def feed(self, request_id: Hashable, codes: torch.Tensor) -> None:
        """Append frames `[num_quantizers, k]`."""
        stream = self.streams[request_id]
        if stream.finished:
            raise ValueError(f"stream {request_id!r} is finished")
        stream.codes = torch.cat([stream.codes, codes.to(self.device, torch.long)], dim=1)

    def finish(self, request_id: Hashable) -> None:
        """No more frames: the rest is decoded even if shorter than a chunk, and the stream then closes."""
        self.streams[request_id].finished = True

    def cancel(self, request_id: Hashable) -> None:
        self.streams.pop(request_id, None)

    @torch.no_grad()
    def step(self) -> list[AudioChunk]:
        """One chunk for every stream that has one ready, in one decode call per chunk size."""
        ready: dict[int, list[Hashable]] = {}
        out = []
        for request_id, stream in list(self.streams.items()):
            size = self.first_chunk if stream.decoded == 0 else self.chunk
            pending = stream.frames - stream.decoded
            if pending >= size or (stream.finished and pending > 0):
                ready.setdefault(size, []).append(request_id)
            elif stream.finished:
                nothing = torch.zeros(0, dtype=self.dtype, device=self.device)
                out.append(AudioChunk(request_id, nothing, final=True))
                del self.streams[request_id]
        for size, ids in ready.items():
            for start in range(0, len(ids), self.max_batch):  # a decode call's memory grows with its rows
                out += self._decode(size, ids[start : start + self.max_batch])
        return out

    def _decode(self, size: int, ids: list[Hashable]) -> list[AudioChunk]:
        spf = self.model.config.samples_per_frame
        # first chunks are their streams' first frames alone (`Code2Wav.decode_window`'s prefix windows)
        context = 0 if size == self.first_chunk and self.prefix_first else self.model.left_context
        windows, starts = [], []
        for request_id in ids:
            stream = self.streams[request_id]
            start = stream.decoded - context  # stream index of the window's first frame
            lo, hi = max(start, stream.first), min(stream.decoded + size, stream.frames)
            window = stream.codes[:, lo - stream.first : hi - stream.first]
            windows.append(F.pad(window, (lo - start, start + context + size - hi)))
            starts.append(start)
        decode = self.model.decode_window if self.decode is None else self.decode
        wav = decode(torch.stack(windows), to_device(torch.tensor(starts), self.device))
        out = []
        for row, request_id in enumerate(ids):
            stream = self.streams[request_id]
            new = min(size, stream.frames - stream.decoded)
            # the first chunk's first `lookahead` samples would come before the stream's sample 0
            skip = max(0, self.model.lookahead - spf * stream.decoded)
            stream.decoded += new
            final = stream.finished and stream.decoded == stream.frames
            out.append(AudioChunk(request_id, wav[row, skip : spf * new], final))
            if final:
                del self.streams[request_id]
            else:
                keep_from = max(stream.first, stream.decoded - self.model.left_context)
                stream.codes = stream.codes[:, keep_from - stream.first :]
                stream.first = keep_from
        return out
