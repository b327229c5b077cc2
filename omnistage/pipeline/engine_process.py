"""The pipeline in its own process, so that the server's event loop and the engine's steps never wait on
one GIL: on a thread of the server's process, every SSE chunk written at c=16 took the GIL from the host
work between the GPU's kernels, and the engine's steps from the loop (benchmarks/RESULTS.md, "The HTTP
server against the engine in-process").

The server's process keeps HTTP, media decoding, templating and tokenizing (its own `Processor`); the engine
process runs a StepLoop over the pipeline. They talk over a pipe in pickled messages: commands (Add, Abort)
one way; each step's outputs, with the engine's stats, the other. Neither side's main work ever waits on the
pipe: the server writes commands from a thread of its own and the engine process drains them on one, since a
write blocks until the other side reads (a request's media can be MBs, a step tens of ms). Outputs travel as deltas: a request's
prompt ids go with its first output only, its cumulative text and ids with its last, and `RemoteOutputs`
rebuilds full RequestOutputs on the server's side. A request's admission error is its stream's first item,
as on a thread. If the engine process dies, every open stream fails and the server reports not ready.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omnistage.config import EngineConfig
from omnistage.engine.memory.gauges import Gauge
from omnistage.errors import ConfigError
from omnistage.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from omnistage.pipeline.family import build_pipeline, frontend_for
from omnistage.pipeline.step_loop import Abort, Add, Delivery, StepLoop, serving_stats

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# torch intra-op threads of the engine process, and of a server beside it (cli/serve.py): two processes of 16-thread
# pools spinning between ops took the cores from each other (H200: c=1 TTFT 65 ms with the default pools, 48 ms
# with one thread each, as with the engine on a thread; benchmarks/RESULTS.md)
ONE_THREAD = 1
_STATS_EVERY_S = 0.1


@dataclass(frozen=True)
class PipelineInfo:
    """What the server's process reads of the pipeline, sent once by the engine process when it is ready: its
    Frontend but the processor (the server's process builds its own), its summary and its first stats."""

    model_path: Path
    max_model_len: int
    voices: tuple[str, ...]
    plan_gauges: tuple[Gauge, ...]
    memory_summary: str
    stats: dict[str, int]


@dataclass(frozen=True)
class Outputs:
    """One step's deliveries, the engine's stats after it, and how many Adds it has admitted so far (or refused,
    or dropped: `StepLoop.taken`)."""

    items: Delivery
    stats: dict[str, int] | None  # None: unchanged enough since the last
    admitted: int


def _send(conn: Connection, message: Any) -> None:
    # plain pickle: tensors travel by value, not as shared-memory handles that need their own lifetimes
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# -- the engine process ------------------------------------------------------------------------------


def _engine_main(config_json: str, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(ONE_THREAD)
    try:
        pipeline = build_pipeline(EngineConfig.model_validate_json(config_json))
    except Exception as exc:
        _send(conn, (exc, traceback.format_exc()))
        return
    gc.collect()
    gc.freeze()  # see AsyncPipeline: the loaded model is never garbage
    front = pipeline.frontend
    info = PipelineInfo(
        front.model_path,
        front.max_model_len,
        front.voices,
        front.plan_gauges,
        pipeline.memory_summary(),
        serving_stats(pipeline),
    )
    _send(conn, info)
    stopped = False
    stale = False  # commands were handled since the server last got the stats
    # The pipe is drained on a thread of its own, so that the server's writes (a request's media can be MBs)
    # never wait for a step to end, nor a step for a write.
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_drain, args=(conn, inbox), name="omnistage-commands", daemon=True).start()

    stats_sent = 0.0
    outputs = SlimOutputs()

    def deliver(items: Delivery) -> None:
        """The outputs, with fresh stats when the last are older than _STATS_EVERY_S or the pipeline is idle
        (reading the allocator's stats every step would cost each step its time)."""
        nonlocal stale, stats_sent
        stale = False
        now = time.monotonic()
        stats = None
        if now - stats_sent > _STATS_EVERY_S or not pipeline.has_unfinished():
            stats, stats_sent = serving_stats(pipeline), now
        _send(conn, Outputs(outputs.slim(items), stats, loop.taken))

    def receive(timeout: float | None) -> list[Add | Abort]:
        nonlocal stopped, stale
        if stale:  # no step followed them (an abort left the pipeline idle): the pages it freed, now
            deliver([])
        commands: list[Add | Abort] = []
        while True:
            try:
                command = inbox.get(block=timeout is not None, timeout=timeout)
            except queue.Empty:
                break
            timeout = None
            if command is None:  # shut down, or the server's process is gone
                stopped = True
                break
            commands.append(command)
        stale = bool(commands)
        return commands

    loop = StepLoop.of(pipeline, deliver)
    loop.run(receive, lambda: stopped)


class SlimOutputs:
    """Outputs without what the server already has: the prompt ids after the first, the cumulative text and
    ids before the last (RemoteOutputs puts them back)."""

    def __init__(self) -> None:
        self._sent_prompt: set[str] = set()

    def slim(self, items: Delivery) -> Delivery:
        out: Delivery = []
        for request_id, item in items:
            if not isinstance(item, RequestOutput):  # a request's error ends its stream
                self._sent_prompt.discard(request_id)
            else:
                first = request_id not in self._sent_prompt
                self._sent_prompt.add(request_id)
                if item.finished:
                    self._sent_prompt.discard(request_id)
                else:
                    item = replace(item, outputs=[_slim(c) for c in item.outputs])
                if not first:
                    item = replace(item, prompt_token_ids=[], prompt=None)
            out.append((request_id, item))
        return out


def _slim(completion: CompletionOutput) -> CompletionOutput:
    """A running completion without its cumulative text, ids and logprobs (its deltas carry them)."""
    logprobs: list[TokenLogprobs] | None = [] if completion.logprobs is not None else None
    return replace(completion, text="", token_ids=[], logprobs=logprobs)


def _drain(conn: Connection, inbox: queue.SimpleQueue) -> None:
    try:
        while True:
            command = _recv(conn)
            inbox.put(command)
            if command is None:
                return
    except (EOFError, OSError):
        inbox.put(None)


# -- the server's side -------------------------------------------------------------------------------


@dataclass
class _Partial:
    prompt: str | None
    prompt_token_ids: list[int]
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class RemoteOutputs:
    """Rebuilds full RequestOutputs from the engine process's slim ones."""

    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def rebuild(self, request_id: str, item: RequestOutput | Exception) -> RequestOutput | Exception:
        if not isinstance(item, RequestOutput):
            self._partial.pop(request_id, None)
            return item
        partial = self._partial.get(request_id)
        if partial is None:
            partial = self._partial[request_id] = _Partial(item.prompt, item.prompt_token_ids)
        if item.finished:
            del self._partial[request_id]
        else:
            completion = item.outputs[0]
            partial.text.append(completion.delta_text)
            partial.token_ids += completion.delta_token_ids
            partial.logprobs += completion.delta_logprobs
            text = "".join(partial.text)
            logprobs = list(partial.logprobs) if completion.logprobs is not None else None
            rebuilt = replace(completion, text=text, token_ids=list(partial.token_ids), logprobs=logprobs)
            item = replace(item, outputs=[rebuilt])
        return replace(item, prompt=partial.prompt, prompt_token_ids=partial.prompt_token_ids)


class RemotePipeline:
    """The pipeline in the engine process as the server's process reads it (a PipelineView, base.py): its
    Frontend around a processor of this process's own, its stats as the engine process last sent them."""

    def __init__(self, info: PipelineInfo) -> None:
        self.info = info
        self.frontend = frontend_for(info.model_path, info.max_model_len, info.voices, info.plan_gauges)
        self.latest_stats = dict(info.stats)

    def memory_summary(self) -> str:
        return self.info.memory_summary

    @property
    def num_waiting(self) -> int:
        return self.latest_stats["num_waiting"]

    def stats(self) -> dict[str, int]:
        return dict(self.latest_stats)


class EngineProcess:
    """Starts the engine process and waits until its pipeline is loaded; then carries commands and outputs."""

    def __init__(self, config: EngineConfig) -> None:
        # spawn: a fresh interpreter, no CUDA state, no threads forked
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_main,
            args=(config.model_dump_json(), child, logging.getLogger().getEffectiveLevel()),
            name="omnistage-engine",
        )
        self.process.start()
        child.close()
        try:
            reply = _recv(self._conn)
        except (EOFError, OSError):
            self.process.join(timeout=5)
            raise ConfigError(
                f"the engine process exited while loading (exit code {self.process.exitcode})"
            ) from None
        if isinstance(reply, tuple):
            exc, trace = reply
            self.process.join(timeout=5)
            log.debug("the engine process failed to start:\n%s", trace)
            raise exc
        self.view = RemotePipeline(reply)
        self.admitted = 0
        self.outputs = RemoteOutputs()
        # commands are pickled and written on a thread: a write waits for the engine process to read, and the
        # event loop that sends them must never wait (at c=16 it did, and every stream's delivery with it)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_forever, name="omnistage-send", daemon=True)
        self._sender.start()

    def send(self, command: Add | Abort | None) -> None:
        self._outbox.put(command)

    def _send_forever(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                _send(self._conn, command)
            except (BrokenPipeError, OSError):
                log.warning("the engine process is gone: %s dropped", type(command).__name__)
                return
            if command is None:
                return

    def receive_forever(self, deliver: Callable[[Delivery], None], on_exit: Callable[[], None]) -> None:
        """Read the engine's messages until it exits (run on a thread of its own)."""
        rebuild = self.outputs.rebuild
        try:
            while True:
                message: Outputs = _recv(self._conn)
                if message.stats is not None:
                    self.view.latest_stats = message.stats
                self.admitted = message.admitted
                deliver([(request_id, rebuild(request_id, item)) for request_id, item in message.items])
        except (EOFError, OSError):
            pass
        finally:
            on_exit()

    def shutdown(self, timeout: float = 10) -> None:
        self.send(None)
        self._sender.join(timeout=timeout)
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=timeout)
        self._conn.close()
