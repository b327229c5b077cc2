"""Streaming Code2Wav: many streams of codec frames decoded chunk by chunk in batched calls, each stream's
chunks together equal to its one-shot decode (see `Code2Wav.decode_chunk`).

A stream holds a slot of `StreamSlots` from its first chunk to its end: what its chunks leave for the next
(each transformer layer's keys and values of its last 71 frames, each convolution's input samples that the
next chunk reads back), so a chunk's call runs over the chunk's own frames alone. Counted with torch's FLOP
counter at the released sizes (`benchmarks/code2wav_profile.py --flops`), a call costs 5.1 GFLOP a stream
per chunk frame: 128 for 25 frames, where decoding each chunk from the 578 frames before it cost 313.
- First chunk, 2 frames (the first packet's latency): the second frame costs one more Talker and
  code-predictor step. In return the first packet holds more than twice the audio, because the decoder's
  look-ahead (555 samples, 29% of a frame) comes off a stream's first chunk only: 1 frame gives 1,365
  samples (57 ms), 2 give 3,285 (137 ms), which play while the next 25 frames are generated.
- Later chunks, 25 frames (throughput): a call's work is the same per frame at any chunk size, so the size
  trades what a call costs whatever its frames (its launches or graph replay, the streams' carried samples)
  against the delay of every packet after the first and a call's activations (streams × frames).
Two sizes also mean two shapes per streams bucket to capture as CUDA graphs (`engine/graphs/code2wav.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnistage.models.layers.attention_metadata import to_device_together
from omnistage.models.qwen3_omni.code2wav import Code2Wav, StreamSlots

DecodeChunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ChunkDecoder:
    """`Code2Wav.decode_chunk` over `slots` streams' state: the call a streamer makes, and the one its CUDA
    graphs capture, `(codes [B, num_quantizers, n], starts [B], slots [B]) -> [B, spf·n]`."""

    def __init__(self, model: Code2Wav, slots: int) -> None:
        self.model = model
        self.state = StreamSlots.allocate(model, slots)

    @property
    def slots(self) -> int:
        return self.state.scratch

    @property
    def scratch(self) -> int:
        return self.state.scratch

    @property
    def state_bytes(self) -> int:
        return self.state.nbytes

    @property
    def num_quantizers(self) -> int:
        return self.model.config.num_quantizers

    @property
    def device(self) -> torch.device:
        return self.state.keys.device

    def __call__(self, codes: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.model.decode_chunk(codes, starts, slots, self.state)


@dataclass(frozen=True)
class AudioChunk:
    request_id: Hashable
    samples: torch.Tensor  # [n] at 24 kHz, the model's dtype
    final: bool  # the stream is finished and this is its last chunk


@dataclass
class _Stream:
    codes: torch.Tensor  # [num_quantizers, k]: the frames not yet decoded
    decoded: int = 0  # frames whose samples were emitted
    slot: int | None = None  # held from the first decode call to the end
    finished: bool = False


class Code2WavStreamer:
    """Decodes many streams of codec frames chunk by chunk, batched; the chunks of a stream, concatenated,
    are its one-shot decode.

    A stream's first chunk holds `first_chunk` frames (small: the first packet's latency), later ones `chunk`,
    the last one what remains at `finish` (right-padded; no emitted sample reads past the stream's last
    frame). One decode call holds at most `max_batch` streams, so a call's shapes depend only on (streams,
    chunk size). A stream takes one of the `slots` state slots at its first chunk and gives it back at its
    end; a stream with a chunk due and no free slot waits for one, in the order the streams opened.

    `decode` runs each call as `ChunkDecoder` does, over a `ChunkDecoder`'s state of `slots` slots (CUDA
    graphs of one, say); None makes one. Its result must be a tensor no later call overwrites: the chunks of
    one `step` are views of its results, read after the step's last call.
    """

    def __init__(
        self,
        model: Code2Wav,
        first_chunk: int = 2,
        chunk: int = 25,
        max_batch: int = 16,
        slots: int = 16,
        decode: DecodeChunk | None = None,
    ) -> None:
        if min(first_chunk, chunk, max_batch, slots) < 1:
            raise ValueError(
                f"chunk sizes, max_batch and slots must be positive, got first_chunk={first_chunk}, "
                f"chunk={chunk}, max_batch={max_batch}, slots={slots}"
            )
        self.model, self.first_chunk, self.chunk, self.max_batch = model, first_chunk, chunk, max_batch
        self.decode = decode or ChunkDecoder(model, slots)
        self.device, self.dtype = model.code_embedding.weight.device, model.code_embedding.weight.dtype
        self.streams: dict[Hashable, _Stream] = {}
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first

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
        if request_id in self.streams:
            self._close(request_id)

    def _close(self, request_id: Hashable) -> None:
        stream = self.streams.pop(request_id)
        if stream.slot is not None:
            self.free.append(stream.slot)

    @torch.no_grad()
    def step(self) -> list[AudioChunk]:
        """One chunk for every stream that has one ready and a slot, in one decode call per chunk size."""
        ready: dict[int, list[Hashable]] = {}
        out = []
        for request_id, stream in list(self.streams.items()):
            size = self.first_chunk if stream.decoded == 0 else self.chunk
            pending = stream.codes.shape[1]
            if pending >= size or (stream.finished and pending > 0):
                if stream.slot is None and self.free:
                    stream.slot = self.free.pop()
                if stream.slot is not None:
                    ready.setdefault(size, []).append(request_id)
            elif stream.finished:
                nothing = torch.zeros(0, dtype=self.dtype, device=self.device)
                out.append(AudioChunk(request_id, nothing, final=True))
                self._close(request_id)
        for size, ids in ready.items():
            for start in range(0, len(ids), self.max_batch):  # a decode call's memory grows with its rows
                out += self._decode(size, ids[start : start + self.max_batch])
        return out

    def _decode(self, size: int, ids: list[Hashable]) -> list[AudioChunk]:
        spf = self.model.config.samples_per_frame
        streams = [self.streams[request_id] for request_id in ids]
        codes = torch.stack([F.pad(s.codes[:, :size], (0, max(0, size - s.codes.shape[1]))) for s in streams])
        starts, slots = to_device_together(
            [torch.tensor([s.decoded for s in streams]), torch.tensor([s.slot for s in streams])], self.device
        )
        wav = self.decode(codes, starts, slots)
        out = []
        for row, (request_id, stream) in enumerate(zip(ids, streams, strict=True)):
            new = min(size, stream.codes.shape[1])
            # the first chunk's first `lookahead` samples would come before the stream's sample 0
            skip = max(0, self.model.lookahead - spf * stream.decoded)
            stream.decoded += new
            stream.codes = stream.codes[:, new:]
            final = stream.finished and not stream.codes.shape[1]
            out.append(AudioChunk(request_id, wav[row, skip : spf * new], final))
            if final:
                self._close(request_id)
        return out
