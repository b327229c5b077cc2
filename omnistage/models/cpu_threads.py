"""A fair share of the CPU's threads for work that requests run at once on worker threads.

torch's CPU kernels run on an OpenMP team as large as the machine for every calling thread; eight requests
preprocessing at once on a 16-core host then ask for 128 spinning threads, and each runs slower than the
eight would one after another (RESULTS.md, "Video in, with its sound"). The team size is the calling
thread's own (`torch.set_num_threads` is per thread with the OpenMP backend), so each caller takes
cores / callers while it works, and a lone request keeps every core. FFmpeg's video decoders take as many
threads as the machine has unless told: `shared_decoder_threads` shares the cores among the videos decoding at
once the same way, counted apart (a video's decoder and its resizes run side by side).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

_cores = torch.get_num_threads()


class _Callers:
    """Callers inside a block, counted under a lock: each entering gets cores / those inside then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0

    @contextmanager
    def share(self) -> Iterator[int]:
        with self._lock:
            self._inside += 1
            share = max(1, _cores // self._inside)
        try:
            yield share
        finally:
            with self._lock:
                self._inside -= 1


_torch_callers = _Callers()
_decoders = _Callers()  # counted apart: a video's decoder and its resizes run side by side


@contextmanager
def shared_threads() -> Iterator[int]:
    """Run the block on this thread's share of the cores (given as the value); restored after."""
    with _torch_callers.share() as share:
        before = torch.get_num_threads()
        torch.set_num_threads(share)
        try:
            yield share
        finally:
            torch.set_num_threads(before)


def shared_decoder_threads() -> AbstractContextManager[int]:
    """The threads a video decoder opened in the block may take: cores / the videos decoding at once, taken on
    entry (a lone video keeps every core)."""
    return _decoders.share()


def cores() -> int:
    """The threads torch's team had when this module was first imported: the cores the shares divide."""
    return _cores
