"""The engine side of AsyncEngine: commands are taken between steps, steps run, their outputs are handed out.

It runs on a thread of the server's process or as the main loop of an engine process (`engine_process.py`);
the two differ only in where commands come from and where outputs go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.engine.llm_engine import NewRequest
from omnistage.outputs import RequestOutput
from omnistage.pipeline.family import Pipeline

log = logging.getLogger(__name__)

Delivery = list[tuple[str, RequestOutput | Exception]]


@dataclass(frozen=True)
class Add:
    request: NewRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


class StepLoop:
    def __init__(
        self,
        pipeline: Pipeline,
        deliver: Callable[[Delivery], None],
        wanted: Callable[[str], bool] = lambda request_id: True,
    ) -> None:
        """`deliver` gets each step's outputs (and admission errors); `wanted` says whether a request's client
        is still there when the loop picks its Add up (one that left is not admitted)."""
        self.pipeline = pipeline
        self.deliver = deliver
        self.wanted = wanted
        self._live: set[str] = set()

    def run(self, receive: Callable[[bool], list[Add | Abort]], stopping: Callable[[], bool]) -> None:
        """Until `stopping()`: the commands `receive(block)` returns (block: the pipeline is idle), then a step."""
        while not stopping():
            try:
                self.handle(receive(not self.pipeline.has_unfinished()))
                if self.pipeline.has_unfinished():
                    self.step()
            except Exception:  # a bug in the loop itself: fail what is running, keep serving
                log.exception("engine loop error")
                failed = [(request_id, RuntimeError("internal engine error")) for request_id in self._live]
                for request_id, _ in failed:
                    self.pipeline.abort(request_id)
                self._live.clear()
                self.deliver(failed)

    def step(self) -> None:
        outputs = self.pipeline.step()
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        self.deliver([(output.request_id, output) for output in outputs])

    def handle(self, commands: list[Add | Abort]) -> None:
        """Commands in arrival order; consecutive adds are admitted as one batch (media encoded together)."""
        adds: list[NewRequest] = []
        for command in commands:
            if isinstance(command, Add):
                adds.append(command.request)
                continue
            self._admit(adds)
            adds = []
            self.pipeline.abort(command.request_id)
            self._live.discard(command.request_id)
        self._admit(adds)

    def _admit(self, requests: list[NewRequest]) -> None:
        requests = [r for r in requests if self.wanted(r.request_id)]
        if not requests:
            return
        errors = self.pipeline.add_requests(requests)
        self._live.update(r.request_id for r, e in zip(requests, errors) if e is None)
        self.deliver([(r.request_id, e) for r, e in zip(requests, errors) if e is not None])
