"""A stage's step on a thread and a CUDA stream of its own, so that its kernels run beside another stage's.

A speaking step runs the Thinker's decode (a 30B MoE at a few rows: kernels that leave most of the GPU idle)
and the Talker, code predictor and Code2Wav (hundreds of small kernels). One after the other on one stream,
each waits for the other; on two streams their kernels interleave. Each side's host work runs while the
other's kernels do: torch releases the GIL inside its ops, so the two threads' Python work interleaves too.

Only the steps run beside go to the side stream (the caller keeps to steps that allocate little: decode
graph replays). Everything else of the stage (its prefills, its admissions) stays on the caller's stream.
The caching allocator keeps each stream's freed blocks for that stream: a stage whose large eager steps
alternated between two streams would need its peak twice, and under a memory plan that leaves nothing spare
every switch would free the other stream's cache (a device synchronisation, then new allocations).

Ordering: the side stream starts a step after the stage's work the caller marked (`mark`, recorded after the
stage's last step or admission on the caller's stream, not after the caller's other work queued since), and
the caller's stream waits for the side stream at `join`, before it reads anything the step made.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class SideStream:
    def __init__(self, device: torch.device, name: str) -> None:
        """Off CUDA there is no stream, only the thread (the step order is the same: tests)."""
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._marked: torch.cuda.Event | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    def mark(self) -> None:
        """The stage's work queued so far on the caller's stream: the next `submit` starts after it."""
        if self.stream is not None:
            self._marked = torch.cuda.current_stream(self.device).record_event()

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """`work()` on the stage's thread and stream, after what was marked; `join` its future."""
        if self.stream is not None and self._marked is not None:
            self.stream.wait_event(self._marked)

        def run() -> T:
            if self.stream is None:
                with torch.inference_mode():
                    return work()
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
                return work()

        return self._thread.submit(run)

    def join(self, future: Future[T]) -> T:
        """The work's result (or its exception); the caller's stream then orders after it."""
        try:
            return future.result()
        finally:
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
