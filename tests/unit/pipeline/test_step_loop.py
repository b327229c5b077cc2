"""The StepLoop's admission (pipeline/step_loop.py) over a fake pipeline: a burst's requests, told as still being
prepared by their caller, are held while the pipeline is idle and admitted in one batch; the admission window
bounds the hold; a busy pipeline or a zero window admits at once, unless the busy pipeline holds its arrivals
for a few steps; an abort drops a held request. A final-only request is delivered its finished output alone."""

from __future__ import annotations

import time

from omnistage.engine.stages.text_setup import NewRequest
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.step_loop import Abort, Add, StepLoop
from omnistage.request import SamplingParams


class FakePipeline:
    """Each admitted request runs `steps` steps, then finishes."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.batches: list[list[str]] = []
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps_run = 0
        self.admitted_after: list[int] = []  # steps run before each batch came in

    def add_requests(self, requests: list[NewRequest]) -> list[Exception | None]:
        self.batches.append([r.request_id for r in requests])
        self.admitted_after.append(self.steps_run)
        self.running.update((r.request_id, self.steps) for r in requests)
        return [None] * len(requests)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        self.steps_run += 1
        outputs = []
        for request_id in list(self.running):
            self.running[request_id] -= 1
            finished = not self.running[request_id]
            if finished:
                del self.running[request_id]
            outputs.append(
                RequestOutput(request_id, None, [], [CompletionOutput(0, "", [])], finished=finished)
            )
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        self.aborted.append(request_id)
        if self.running.pop(request_id, None) is None:
            return None
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")], finished=True)


def add(request_id: str, more_coming: int, final_only: bool = False) -> Add:
    return Add(
        NewRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), final_only=final_only), more_coming
    )


def run(loop: StepLoop, script: list[list[Add | Abort]], pause_s: float = 0.0) -> list[float | None]:
    """Feed `script`'s command lists, one per `receive` call (then nothing until the pipeline is idle, then stop);
    `pause_s`: each call first waits that long or its timeout, whichever is shorter. Returns the timeouts."""
    timeouts: list[float | None] = []
    remaining = list(script)
    stop = [False]

    def receive(timeout: float | None) -> list[Add | Abort]:
        timeouts.append(timeout)
        if timeout is not None:
            time.sleep(min(timeout, pause_s))
        if remaining:
            return remaining.pop(0)
        if not loop.pipeline.has_unfinished() and not loop._held:
            stop[0] = True
        return []

    loop.run(receive, lambda: stop[0])
    return timeouts


def test_a_burst_is_held_while_idle_and_admitted_in_one_batch():
    pipeline = FakePipeline()
    loop = StepLoop(pipeline, lambda items: None, admission_window_s=60.0)
    timeouts = run(loop, [[add("a", 2)], [add("b", 1), add("c", 1)], [add("d", 0)]])
    assert pipeline.batches == [["a", "b", "c", "d"]]
    # while holding, each wait is bounded by what is left of the window, not the idle poll
    assert all(t is not None and 59.0 < t <= 60.0 for t in timeouts[1:3])


def test_the_window_bounds_the_hold():
    """The burst's last request never comes (it failed in its preparation): the first goes in once the window
    has passed, the late one on its own."""
    pipeline = FakePipeline()
    loop = StepLoop(pipeline, lambda items: None, admission_window_s=0.05)
    start = time.monotonic()
    run(loop, [[add("a", 1)], [], [], [], [], [add("late", 0)]], pause_s=0.02)
    assert pipeline.batches == [["a"], ["late"]]
    assert time.monotonic() - start >= 0.05


def test_a_busy_pipeline_or_a_zero_window_admits_at_once():
    pipeline = FakePipeline(steps=3)
    loop = StepLoop(pipeline, lambda items: None, admission_window_s=60.0)
    run(loop, [[add("a", 0)], [add("b", 5)], [add("c", 5)]])
    assert pipeline.batches == [["a"], ["b"], ["c"]]  # a is running when b and c come: no wait

    pipeline = FakePipeline()
    run(StepLoop(pipeline, lambda items: None, admission_window_s=0.0), [[add("a", 3)], [add("b", 2)]])
    assert pipeline.batches == [["a"], ["b"]]


def test_a_busy_pipeline_holds_its_arrivals_for_the_steps_asked_then_admits_them_together():
    script = [[add("a", 0)], [add("b", 0)], [add("c", 0)], [], [], [add("d", 0)]]
    pipeline = FakePipeline(steps=20)
    run(StepLoop(pipeline, lambda items: None, admission_hold_steps=3), script)
    # b came after step 1 and waited three steps; c, after step 2, went in with it; d waited three steps of its own
    assert pipeline.batches == [["a"], ["b", "c"], ["d"]]
    assert pipeline.admitted_after == [0, 4, 8]

    pipeline = FakePipeline(steps=20)
    run(StepLoop(pipeline, lambda items: None, admission_hold_steps=0), script)
    assert pipeline.batches == [["a"], ["b"], ["c"], ["d"]]
    assert pipeline.admitted_after == [0, 1, 2, 5]


def test_requests_held_by_a_busy_pipeline_go_in_at_once_when_it_has_nothing_left():
    """Not after the idle pipeline's admission window, though the caller says more are coming."""
    pipeline = FakePipeline(steps=2)
    loop = StepLoop(pipeline, lambda items: None, admission_window_s=60.0, admission_hold_steps=10)
    start = time.monotonic()
    timeouts = run(loop, [[add("a", 0)], [add("b", 5)]])
    assert pipeline.batches == [["a"], ["b"]]
    assert pipeline.admitted_after == [0, 2]  # a ended in step 2, with b held for one step
    assert timeouts[2] is None and time.monotonic() - start < 5.0


def test_held_requests_are_not_taken_until_they_go_in_or_are_dropped():
    """`taken` counts the Adds admitted, refused or dropped; its caller counts the rest as waiting."""
    pipeline = FakePipeline(steps=20)
    loop = StepLoop(pipeline, lambda items: None, admission_hold_steps=2)
    loop.handle([add("a", 0)])
    assert loop.taken == 1  # the idle loop admitted it
    loop.step()
    loop.handle([add("b", 0), add("c", 0), add("d", 0)])
    assert loop.taken == 1  # held by the busy loop
    loop.handle([Abort("c")])
    assert loop.taken == 2  # dropped while held
    loop.step()
    loop.step()
    loop.handle([])
    assert loop.taken == 4 and pipeline.batches == [["a"], ["b", "d"]]


def test_an_abort_drops_a_held_request():
    pipeline = FakePipeline()
    delivered = []
    loop = StepLoop(pipeline, delivered.extend, admission_window_s=60.0)
    run(loop, [[add("a", 1)], [Abort("a")], [add("b", 0)]])
    assert pipeline.batches == [["b"]]
    assert {request_id for request_id, _ in delivered} == {"b"}


def test_a_final_only_request_is_delivered_its_last_output_alone():
    """Beside a streamed request of the same steps, and when aborted mid-way (its abort output is its last)."""
    pipeline = FakePipeline(steps=3)
    delivered: list[tuple[str, RequestOutput | Exception]] = []
    loop = StepLoop(pipeline, delivered.extend)
    run(
        loop,
        [
            [add("streamed", 0), add("final", 0, final_only=True), add("cut", 0, final_only=True)],
            [Abort("cut")],
        ],
    )
    by_request: dict[str, list] = {}
    for request_id, item in delivered:
        by_request.setdefault(request_id, []).append(item)
    assert [o.finished for o in by_request["streamed"]] == [False, False, True]
    assert [o.finished for o in by_request["final"]] == [True]
    (cut,) = by_request["cut"]
    assert cut.finished and cut.outputs[0].finish_reason == "abort"
    assert not loop._final_only and not loop._live
