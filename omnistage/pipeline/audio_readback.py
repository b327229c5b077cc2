"""Code2Wav's audio chunks on their way to the host, one speaking step late on a GPU.

Reading a chunk back as it is made waits for everything queued on the stream, Code2Wav's call included: the
engine thread then cannot prepare the next step while the GPU decodes. On a GPU a step's chunks are copied
into pinned memory without waiting and taken by the next speaking step, whose Talker step has read its own
ids back by then (so the copy is done and the wait costs nothing). A step that holds a stream's first chunk
reads its chunks at once: the first packet's latency is what a listener waits for, while a later chunk has
the audio before it still playing. Under load most steps hold no first chunk (benchmarks/RESULTS.md,
"Realtime sessions, a third time", has where the engine thread waited).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnistage.models.qwen3_omni.code2wav_streamer import AudioChunk


@dataclass(frozen=True)
class HostChunk:
    """A chunk's samples on the host (float32, 24 kHz)."""

    request_id: str
    samples: np.ndarray
    final: bool


class AudioReadback:
    """The chunks of each speaking step, read back at once or (`deferred`) one step later."""

    def __init__(self, deferred: bool) -> None:
        self.deferred = deferred
        self._copies: list[tuple[AudioChunk, torch.Tensor]] = []  # the step before's, on their way
        self._copied: torch.cuda.Event | None = None

    @property
    def pending(self) -> int:
        """Chunks copied and not yet delivered."""
        return len(self._copies)

    def exchange(self, chunks: list[AudioChunk], urgent: bool) -> list[HostChunk]:
        """The chunks to deliver now: the step before's, then this step's own where it does not defer them (or
        holds an `urgent` one)."""
        ready = self._landed()
        if not self.deferred or urgent:
            return ready + [
                HostChunk(str(c.request_id), c.samples.float().cpu().numpy(), c.final) for c in chunks
            ]
        self._copies = []
        for chunk in chunks:
            samples = chunk.samples.float()
            host = torch.empty(samples.shape, dtype=torch.float32, pin_memory=samples.is_cuda)
            self._copies.append((chunk, host.copy_(samples, non_blocking=samples.is_cuda)))
        if self._copies and self._copies[0][1].is_pinned():
            self._copied = torch.cuda.Event()
            self._copied.record()
        return ready

    def _landed(self) -> list[HostChunk]:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        copies, self._copies = self._copies, []
        # copied out of the pinned buffer, which goes back to its pool: a request keeps its audio to its end
        return [HostChunk(str(chunk.request_id), host.numpy().copy(), chunk.final) for chunk, host in copies]
