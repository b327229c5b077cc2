"""The pipeline fed from asyncio: the event loop never waits on model work.

The pipeline runs a StepLoop on a thread of this process (`AsyncPipeline(pipeline)`), or in an engine process
of its own (`from_config(..., engine_process=True)`, what `omnistage serve` does: see engine_process.py).
Requests come in built and checked by their caller (omnistage/request.py), are queued as commands, and are
picked up between steps, all those waiting at once (their media go through the encoders together), where the
pipeline checks what only it can; each step's outputs, and each refused request's error, are handed back to
the loop thread-safely. A consumer that stops iterating (a client that went away) aborts its request, which
frees its pages at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequest, QueueFull
from omnistage.outputs import RequestOutput
from omnistage.pipeline.base import Frontend, Pipeline, PipelineView
from omnistage.pipeline.engine_process import EngineProcess
from omnistage.pipeline.family import build_pipeline
from omnistage.pipeline.step_loop import Abort, Add, Delivery, StepLoop, serving_stats
from omnistage.request import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


class AsyncPipeline:
    """A pipeline's requests as async streams of outputs: what the server and the in-process benches talk to.
    `frontend` is what a server may know of the pipeline; `pipeline` is the pipeline itself, or, in an engine
    process, how this process reads it."""

    def __init__(self, pipeline: Pipeline | EngineProcess, max_queue: int | None = None) -> None:
        self.max_queue = max_queue
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and the queued count
        self._added = 0  # Adds sent; the engine side has picked up `_queued()` fewer
        self._preparing = 0  # requests the caller is preparing (`preparing`), told with each Add
        self._stopping = threading.Event()
        self._gone = threading.Event()  # the engine process exited: not ready, before its reader thread ends
        # Everything loaded so far (the model's modules, torch, the tokenizer) lives as long as the process:
        # moved out of the collector's view, a full collection triggered by serving's garbage no longer
        # walks it while every thread, the engine's included, waits on the GIL.
        gc.collect()
        gc.freeze()
        if isinstance(pipeline, EngineProcess):
            self._process: EngineProcess | None = pipeline
            self.pipeline: PipelineView = pipeline.view
            target = self._receive_from_process
        else:
            self._process = None
            self.pipeline = self._local = pipeline
            self._commands: queue.SimpleQueue = queue.SimpleQueue()
            self._step_loop = StepLoop.of(pipeline, self._deliver_all, self._wanted)
            target = self._run_here
        self.frontend: Frontend = self.pipeline.frontend
        self._thread = threading.Thread(target=target, name="omnistage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_queue: int | None = None, engine_process: bool = False
    ) -> AsyncPipeline:
        pipeline = EngineProcess(config) if engine_process else build_pipeline(config)
        return cls(pipeline, max_queue)

    def preparing(self) -> Preparing:
        """A request its caller is preparing for `generate` (parsing, media decoding, the processor): until its
        `done()`, each request handed over says one more is coming, and an idle engine holds it for the burst
        (step_loop.py). Give it to `generate`, which marks it done as the request goes in; mark it done also
        when the request fails before."""
        with self._lock:
            self._preparing += 1
        return Preparing(self)

    def _prepared(self) -> None:
        with self._lock:
            self._preparing -= 1

    @property
    def ready(self) -> bool:
        alive = self._process is None or self._process.process.is_alive()
        return alive and self._thread.is_alive() and not (self._stopping.is_set() or self._gone.is_set())

    def _queued(self) -> int:
        """Adds the engine side has not admitted yet (sent, or held for a burst or a busy engine's next ones)."""
        taken = self._process.admitted if self._process is not None else self._step_loop.taken
        return self._added - taken

    def memory_summary(self) -> str:
        return self.pipeline.memory_summary()

    def stats(self) -> dict[str, int]:
        # an engine process sends its stats with the builds counted on its side
        stats = self.pipeline.stats() if self._process is not None else serving_stats(self._local)
        stats["num_waiting"] += self._queued()
        return stats

    async def generate(
        self, request: GenerationRequest, preparing: Preparing | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request, one per engine step that touched it (a `final_only` request's last alone); the
        last has finished=True. What keeps the request out (the pipeline's checks at admission, a full queue) is
        raised by the first.

        With `speech`, the reply is also spoken: outputs carry `audio_delta` chunks as they are decoded.
        `preparing`: the request's count among those being prepared (`preparing()`), done as it is sent."""
        if preparing is not None:
            preparing.done()
        request_id = request.request_id
        submitted, delivered = time.monotonic(), None
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            waiting = self.pipeline.num_waiting + self._queued()
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({waiting} requests waiting, the limit is {self.max_queue})"
                )
            self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
            self._added += 1
            more_coming = self._preparing
        self._send(Add(request, more_coming))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, Exception):
                    raise item
                # this side's times beside the engine's (one monotonic clock for every process of the host); a
                # final-only request's first output is its last: no token of it was delivered before the end
                item.metrics["submitted"] = submitted
                if not request.final_only:
                    delivered = delivered or time.monotonic()
                    item.metrics["delivered"] = delivered
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(Abort(request_id))

    async def prefill(self, request: GenerationRequest) -> None:
        """Prefill `request`'s prompt into the Thinker's prefix cache without replying: its full pages stay
        cached for a later request that starts with them (README, "Prefix caching"). A realtime session calls
        it with a turn's prompt so far as the user's audio arrives, so that at the end of speech only the
        pages after the last one prefilled remain to compute. The engine ends a request at a sample, so this
        one samples one greedy token and drops it: one row of the LM head beyond the prompt. Raises what
        keeps the request out, as `generate` does."""
        quiet = replace(request, params=SamplingParams(max_tokens=1, temperature=0.0), speech=None)
        async for _ in self.generate(quiet):
            pass

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def shutdown(self) -> None:
        self._stopping.set()
        if self._process is not None:
            self._process.shutdown()
        else:
            self._commands.put(None)
        self._thread.join(timeout=10)

    def _send(self, command: Add | Abort | None) -> None:
        if self._process is not None:
            self._process.send(command)
        else:
            self._commands.put(command)

    # -- the engine thread, or the thread reading the engine process ----------------------------------

    def _deliver_all(self, items: Delivery) -> None:
        """Hand items to their streams with one wake-up per event loop, not one per request: each wake-up
        is a write to the loop's self-pipe, and at c=16 those writes cost the engine thread a share of
        every step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | Exception]]] = {}
        with self._lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:
                    loop, out_queue = target
                    by_loop.setdefault(loop, []).append((out_queue, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _wanted(self, request_id: str) -> bool:
        """Whether the client of a request is still there (one may leave before its Add is picked up)."""
        with self._lock:
            return request_id in self._streams

    def _run_here(self) -> None:
        self._step_loop.run(self._take, self._stopping.is_set)

    def _take(self, timeout: float | None) -> list[Add | Abort]:
        """The commands queued so far; with a `timeout`, waits up to that many seconds for the first."""
        commands = []
        while True:
            try:
                command = self._commands.get(block=timeout is not None, timeout=timeout)
            except queue.Empty:
                break
            timeout = None
            if command is not None:
                commands.append(command)
        return commands

    def _receive_from_process(self) -> None:
        process = self._process
        assert process is not None  # this thread runs only beside an engine process

        def engine_gone() -> None:
            if self._stopping.is_set():
                return
            self._gone.set()
            log.error("the engine process exited (code %s)", process.process.exitcode)
            with self._lock:
                gone = list(self._streams)
            self._deliver_all(
                [(request_id, RuntimeError("the engine process exited")) for request_id in gone]
            )

        process.receive_forever(self._deliver_all, engine_gone)


class Preparing:
    """`AsyncPipeline.preparing`'s count of one request; `done()` takes it off (once, however often called)."""

    def __init__(self, pipeline: AsyncPipeline) -> None:
        self._pipeline: AsyncPipeline | None = pipeline

    def done(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline._prepared()


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for out_queue, item in batch:
        out_queue.put_nowait(item)
