"""The engine side of AsyncPipeline: commands are taken between steps, steps run, their outputs are handed out.

It runs on a thread of the server's process or as the main loop of an engine process (`engine_process.py`);
the two differ only in where commands come from and where outputs go.

A burst is admitted together: when the pipeline is idle and a request arrives while its caller is still
preparing others (`Add.more_coming`, e.g. a server parsing and decoding the media of requests that came in
with it), it is held until the last of them arrives or the admission window passes, so that their media go
through the encoders in one pass and their prompts prefill in one step. Otherwise each group that happened
to be ready first would take a prefill of its own, and the later ones would wait for it.

A busy pipeline may hold its arrivals too (`admission_hold_steps`, 0 by default: admitted at the next step): up
to that many steps, then together. A server of many short requests (Qwen3-ASR at c=128 admits two or three
requests a step) otherwise encodes media and prefills prompts on nearly every step, and a step with prompt rows
costs more than a pure decode step whatever its rows (benchmarks/RESULTS.md, "Arrivals held for a few steps").
Measured on an H100, holding 4 steps lowered that load's TPOT but not its throughput, hence the default
("Qwen3-ASR at c=128 on two H100 hosts").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.engine.compile_watch import builds_while_serving, watch_compiles
from omnistage.outputs import RequestOutput
from omnistage.pipeline.base import Pipeline
from omnistage.request import GenerationRequest

log = logging.getLogger(__name__)

Delivery = list[tuple[str, RequestOutput | Exception]]
IDLE_POLL_S = 0.5  # how long an idle loop waits for a command before it looks at `stopping` again


def serving_stats(pipeline: Pipeline) -> dict[str, int]:
    """The pipeline's stats and the count of kernels and graphs built since serving began (compile_watch.py):
    what the engine's side reports to the server's /metrics."""
    return pipeline.stats() | {"builds_while_serving": len(builds_while_serving())}


@dataclass(frozen=True)
class Add:
    request: GenerationRequest
    more_coming: int = 0  # requests its caller was still preparing when it sent this one


@dataclass(frozen=True)
class Abort:
    request_id: str


class StepLoop:
    def __init__(
        self,
        pipeline: Pipeline,
        deliver: Callable[[Delivery], None],
        wanted: Callable[[str], bool] = lambda request_id: True,
        admission_window_s: float = 0.0,
        admission_hold_steps: int = 0,
    ) -> None:
        """`deliver` gets each step's outputs (and admission errors); `wanted` says whether a request's client
        is still there when the loop picks its Add up (one that left is not admitted); `admission_window_s`:
        the longest an idle pipeline holds a request for a burst, `admission_hold_steps` the most steps a busy
        one holds its arrivals (see the module's docstring; 0: never held)."""
        self.pipeline = pipeline
        self.deliver = deliver
        self.wanted = wanted
        self.admission_window_s = admission_window_s
        self.admission_hold_steps = admission_hold_steps
        self._live: set[str] = set()
        # of those, the ones whose outputs before the last are not delivered
        self._final_only: set[str] = set()
        self._held: list[GenerationRequest] = []
        self._held_until = 0.0
        self._steps_held = 0  # steps run since the first of the held requests came
        # Adds that have left this loop's hands: admitted, refused, or dropped (aborted while held, their client
        # gone); those held are not, and the caller counts them as waiting
        self.taken = 0

    @classmethod
    def of(
        cls,
        pipeline: Pipeline,
        deliver: Callable[[Delivery], None],
        wanted: Callable[[str], bool] = lambda request_id: True,
    ) -> StepLoop:
        """The loop of `pipeline`, holding arrivals as its config says."""
        config = pipeline.config
        return cls(pipeline, deliver, wanted, config.admission_window_ms / 1e3, config.admission_hold_steps)

    def run(self, receive: Callable[[float | None], list[Add | Abort]], stopping: Callable[[], bool]) -> None:
        """Until `stopping()`: the commands `receive(timeout)` returns (None: those queued, without waiting;
        else waiting up to `timeout` seconds for the first), then a step. From here on, a kernel or graph built
        for a step is logged (compile_watch.py)."""
        watch_compiles()
        while not stopping():
            try:
                self.handle(receive(self._timeout()))
                if self.pipeline.has_unfinished():
                    self.step()
            except Exception:  # a bug in the loop itself: fail what is running, keep serving
                log.exception("engine loop error")
                failed: Delivery = [
                    (request_id, RuntimeError("internal engine error")) for request_id in self._live
                ]
                failed += [(r.request_id, RuntimeError("internal engine error")) for r in self._held]
                self.taken += len(self._held)
                for request_id, _ in failed:
                    self.pipeline.abort(request_id)
                self._live.clear()
                self._final_only.clear()
                self._held.clear()
                self.deliver(failed)

    def _timeout(self) -> float | None:
        if self.pipeline.has_unfinished() or (self._held and self._steps_held):
            return None
        if self._held:
            return max(0.0, self._held_until - time.monotonic())
        return IDLE_POLL_S

    def step(self) -> None:
        """One step of the pipeline; its outputs delivered, but a final-only request's until its last."""
        delivery: Delivery = []
        self._steps_held += bool(self._held)
        for output in self.pipeline.step():
            if output.finished:
                self._live.discard(output.request_id)
                self._final_only.discard(output.request_id)
            elif output.request_id in self._final_only:
                continue
            delivery.append((output.request_id, output))
        self.deliver(delivery)

    def handle(self, commands: list[Add | Abort]) -> None:
        """Commands in arrival order; the adds are admitted as one batch (media encoded together), or held for
        the rest of a burst while the pipeline is idle, for a few steps while it is busy. An abort drops its
        request wherever it is, and its final output (finish_reason "abort") is delivered: an engine process's
        bookkeeping of a request, and the server's, end with its finished output."""
        burst_complete = None  # as the newest add says, if any came
        aborted: Delivery = []
        for command in commands:
            if isinstance(command, Add):
                if not self._held:
                    self._held_until = time.monotonic() + self.admission_window_s
                    self._steps_held = 0
                self._held.append(command.request)
                burst_complete = command.more_coming == 0
                continue
            before = len(self._held)
            self._held = [r for r in self._held if r.request_id != command.request_id]
            self.taken += before - len(self._held)
            out = self.pipeline.abort(command.request_id)
            if out is not None:
                aborted.append((command.request_id, out))
            self._live.discard(command.request_id)
            self._final_only.discard(command.request_id)
        if aborted:
            self.deliver(aborted)
        if self._held and self._release(burst_complete):
            held, self._held = self._held, []
            self._admit(held)

    def _release(self, burst_complete: bool | None) -> bool:
        """Whether the held requests go in now: a busy pipeline's after `admission_hold_steps` steps, an idle
        one's once their burst is complete or the admission window has passed, or at once where a busy
        pipeline held them (its steps have ended)."""
        if self.pipeline.has_unfinished():
            return self._steps_held >= self.admission_hold_steps
        return bool(burst_complete) or self._steps_held > 0 or time.monotonic() >= self._held_until

    def _admit(self, requests: list[GenerationRequest]) -> None:
        self.taken += len(requests)
        requests = [r for r in requests if self.wanted(r.request_id)]
        if not requests:
            return
        errors = self.pipeline.add_requests(requests)
        self._live.update(r.request_id for r, e in zip(requests, errors) if e is None)
        self._final_only.update(r.request_id for r, e in zip(requests, errors) if e is None and r.final_only)
        self.deliver([(r.request_id, e) for r, e in zip(requests, errors) if e is not None])
