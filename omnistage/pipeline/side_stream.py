"""A stage's step on a thread and a CUDA stream of its own, so that its kernels run beside another stage's.

A speaking step runs the Thinker's decode (a 30B MoE at a few rows: kernels that leave most of the GPU idle)
and the Talker, code predictor and Code2Wav (hundreds of small kernels). One after the other on one stream,
each waits for the other; on two streams their kernels interleave. Each side's host work runs while the
other's kernels do: torch releases the GIL inside its ops, so the two threads' Python work interleaves too.

The stage's device work all goes to its stream (its steps here, and whatever the caller runs `inside()`, as
its admissions), and the caller's stream waits for the stage's at `join`, before it reads anything the stage
made. A tensor made on the stage's stream and read on the caller's must be marked with `record_stream` before
it is dropped, so that the allocator does not hand its memory back to the stage while the caller's reads are
queued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class SideStream:
    def __init__(self, device: torch.device, name: str) -> None:
        """Off CUDA there is no stream, only the thread (the step order is the same: tests)."""
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread's work on the stage's stream (e.g. admitting requests between steps)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def _order_after(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """`work()` on the stage's thread and stream; `join` its future."""

        def run() -> T:
            with self.inside(), torch.inference_mode():
                return work()

        return self._thread.submit(run)

    def run(self, work: Callable[[], T]) -> T:
        """`work()` on the calling thread, on the stage's stream; the calling thread's stream then orders after it
        (a step with nothing to run beside it: no thread hop)."""
        try:
            with self.inside():
                return work()
        finally:
            self._order_after()

    def join(self, future: Future[T]) -> T:
        """The work's result (or its exception); the calling thread's stream then orders after it."""
        try:
            return future.result()
        finally:
            self._order_after()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
