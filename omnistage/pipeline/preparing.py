"""The worker threads an event loop prepares requests on for a pipeline: the body parsed, the media decoded,
the prompt laid out by the processor (`asyncio.to_thread`). A preparation may wait there (for the interpreter's
lock, a large video's decoding). The loop's default pool, min(32, cores + 4) threads (20 on a 16-core host),
held a c=128 load of short clips back when their mel features waited for batches on the GPU here
(benchmarks/RESULTS.md, "Requests prepared at once"); the encoder stage makes them now. No torch here: the HTTP
clients of the benchmarks import it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

PREPARING_THREADS = 256  # requests prepared at once; the threads are started as they are needed


def prepare_on_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Give `loop` a default pool of `PREPARING_THREADS` threads."""
    loop.set_default_executor(ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="omnistage-prepare"))
