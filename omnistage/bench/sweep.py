"""The concurrency sweep every benchmark harness runs: passes of requests, at most c in flight at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from omnistage.pipeline.preparing import prepare_on_threads

log = logging.getLogger("omnistage.bench")

Item = TypeVar("Item")
Timing = TypeVar("Timing")
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the event loop the server runs on: uvloop where it is installed (uvicorn picks
    it then), with the server's threads for the requests being prepared, so that clients and in-process
    consumers pay for their loop what the server pays for its own."""
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        prepare_on_threads(runner.get_loop())
        return runner.run(main)


async def sweep(
    run: Callable[[Item, int], Awaitable[Timing]],
    inputs: Sequence[Item],
    concurrencies: list[int],
    summarize: Callable[[list[Timing], list[float], int], dict[str, Any]],
    count: Callable[[int], int] | None = None,
    warmup: int = 1,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Per concurrency c: `repeats` passes of `count(c)` requests (default: one per input) cycling over
    `inputs`, at most c in flight; `summarize(timings, pass walls, c)` of each. `warmup` requests go first,
    unmeasured; every request gets its own number (negative for the warm-up)."""
    for i in range(warmup):
        await run(inputs[i % len(inputs)], -1 - i)
    results, counter = [], 0
    for concurrency in concurrencies:
        gate = asyncio.Semaphore(concurrency)
        requests = count(concurrency) if count else len(inputs)
        timings: list[Timing] = []
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            timings += await asyncio.gather(
                *(_gated(gate, run, inputs[i % len(inputs)], counter + i) for i in range(requests))
            )
            walls.append(time.perf_counter() - start)
            counter += requests
        summary = summarize(timings, walls, concurrency)
        log.info("c=%d: %s", concurrency, summary)
        results.append(summary)
    return results


async def _gated(
    gate: asyncio.Semaphore, run: Callable[[Item, int], Awaitable[Timing]], item: Item, number: int
) -> Timing:
    async with gate:
        return await run(item, number)
