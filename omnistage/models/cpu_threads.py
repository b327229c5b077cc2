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
from contextlib import contextmanager

import torch

_lock = threading.Lock()
_active = 0  # callers inside `shared_threads`
_decoding = 0  # callers inside `shared_decoder_threads`
_cores = torch.get_num_threads()


def _share(callers: int) -> int:
    return max(1, _cores // max(1, callers))


@contextmanager
def shared_threads() -> Iterator[int]:
    """Run the block on this thread's share of the cores (given as the value); restored after."""
    global _active
    with _lock:
        _active += 1
        share = _share(_active)
    before = torch.get_num_threads()
    torch.set_num_threads(share)
    try:
        yield share
    finally:
        torch.set_num_threads(before)
        with _lock:
            _active -= 1


@contextmanager
def shared_decoder_threads() -> Iterator[int]:
    """The threads a video decoder opened in the block may take: cores / the videos decoding at once, taken on
    entry (a lone video keeps every core)."""
    global _decoding
    with _lock:
        _decoding += 1
        share = _share(_decoding)
    try:
        yield share
    finally:
        with _lock:
            _decoding -= 1


def cores() -> int:
    """The threads torch's team had when this module was first imported: the cores the shares divide."""
    return _cores
