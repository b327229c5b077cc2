"""How long a call's GPU work takes, measured where start-up chooses between kernels and in benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_ms(call: Callable[[], object], reps: int = 5, warmup: int = 2) -> float:
    """Median ms of `call()` on the current CUDA stream over `reps` calls, by CUDA events, after `warmup`."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
