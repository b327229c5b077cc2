"""The worker threads an event loop prepares requests on for a pipeline: the body parsed, the media decoded,
the prompt laid out by the processor (`asyncio.to_thread`). A preparation may wait there: Qwen3-ASR's mel
features wait for their batch on the GPU. The loop's default pool, min(32, cores + 4) threads (20 on a 16-core
host), then held a c=128 load of short clips back before the mel (benchmarks/RESULTS.md, "Requests prepared at
once"). No torch here: the HTTP clients of the benchmarks import it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

PREPARING_THREADS = 256  # requests prepared at once; the threads are started as they are needed


def prepare_on_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Give `loop` a default pool of `PREPARING_THREADS` threads."""
    loop.set_default_executor(ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="omnistage-prepare"))
