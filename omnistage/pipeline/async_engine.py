"""The pipeline on its own thread, fed from asyncio: the event loop never waits on model work.

Requests are validated on the caller's side (pure arithmetic), queued as commands, and picked up by the
engine thread between steps, all those waiting at once (their media go through the encoders together);
each step's outputs are handed back to the loop thread-safely. A consumer that stops iterating (a client
that went away) aborts its request, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omnistage.config import EngineConfig
from omnistage.engine.llm_engine import NewRequest
from omnistage.engine.sampling import SamplingParams, SpeechParams
from omnistage.errors import InvalidRequest, QueueFull
from omnistage.models.layers.rotary import PromptPositions
from omnistage.outputs import RequestOutput
from omnistage.pipeline.qwen3_omni import Qwen3OmniPipeline

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.processor import MultimodalInputs

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Qwen3OmniPipeline, max_queue: int | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and the queued count
        self._queued = 0  # added but not yet picked up by the engine thread
        self._stopping = threading.Event()
        # Everything loaded so far (the model's modules, torch, the tokenizer) lives as long as the process:
        # moved out of the collector's view, a full collection triggered by serving's garbage no longer
        # walks it while every thread, the engine's included, waits on the GIL.
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="omnistage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_queue: int | None = None) -> AsyncEngine:
        return cls(Qwen3OmniPipeline(config), max_queue)

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def stats(self) -> dict[str, int]:
        stats = self.engine.stats()
        stats["num_waiting"] += self._queued
        return stats

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mrope: PromptPositions | None = None,
        mm: MultimodalInputs | None = None,
        speech: SpeechParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, one per engine step that touched it; the last has finished=True.

        With `speech`, the reply is also spoken: outputs carry `audio_delta` chunks as they are decoded."""
        self.engine.validate(prompt_token_ids, params, speech)
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            waiting = self.engine.num_waiting + self._queued
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({waiting} requests waiting, the limit is {self.max_queue})"
                )
            self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
            self._queued += 1
        self._commands.put(("add", request_id, prompt, prompt_token_ids, params, mrope, mm, speech))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    # -- the engine thread --------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
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

    def _admit(self, adds: list[tuple]) -> None:
        """Admit the queued requests whose clients are still there, their media encoded together."""
        requests = []
        with self._lock:
            self._queued -= len(adds)
            for _, request_id, prompt, token_ids, params, mrope, mm, speech in adds:
                if request_id in self._streams:  # else the client left before the engine saw it
                    requests.append(NewRequest(request_id, token_ids, params, prompt, mrope, mm, speech))
        for request, error in zip(requests, self.engine.add_requests(requests)):
            if error is not None:
                self._deliver(request.request_id, error)

    def _handle(self, commands: list[tuple]) -> None:
        """Commands in arrival order; consecutive adds are admitted as one batch."""
        adds: list[tuple] = []
        for command in commands:
            if command[0] == "add":
                adds.append(command)
                continue
            if adds:
                self._admit(adds)
                adds = []
            if command[0] == "abort":
                self.engine.abort(command[1])
        if adds:
            self._admit(adds)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                block = not self.engine.has_unfinished()
                commands = []
                while True:
                    try:
                        commands.append(self._commands.get(block=block, timeout=0.5 if block else None))
                    except queue.Empty:
                        break
                    block = False
                self._handle(commands)
                if self.engine.has_unfinished():
                    self._deliver_all([(output.request_id, output) for output in self.engine.step()])
            except Exception:  # a bug in the loop itself: fail what is running, keep serving
                log.exception("engine loop error")
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._deliver(request_id, RuntimeError("internal engine error"))


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for out_queue, item in batch:
        out_queue.put_nowait(item)
