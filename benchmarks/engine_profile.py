"""Where the engine's thread spends a serving benchmark's time, by function, and what every thread costs.

    python benchmarks/engine_profile.py --out $OUT/engine_profile.json -- bench a2t --load-format dummy \
        --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 4 --repeats 1

Runs the `omnistage` command after `--` in this process. From the step after the first request a text stage admits
(the engine built, its graphs captured) to the engine loop's last step, the engine's thread runs under cProfile
(wall-clock timer: a function's own time holds its waits for the device and for the GIL), and each thread's CPU
time is read from /proc over the same span. Prints the profiled wall time, the steps and requests in it, the
functions with the most own time and the engine's main calls (cumulative), each per step; and the CPU
seconds of each kind of thread against the span's wall seconds (all threads share one interpreter lock, so
their Python work together cannot exceed the wall time). cProfile slows the profiled thread's Python; compare
shares, not the benchmark's figures.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import re
import threading
import time
from typing import Any

from in_process import command_of, command_parser, reraise, run

from omnistage.engine.stages.text_admission import TextAdmission
from omnistage.pipeline.step_loop import StepLoop

# the engine's calls whose cumulative time per step is printed (file suffix, function)
MAIN_CALLS = [
    ("pipeline/step_loop.py", "handle"),
    ("pipeline/step_loop.py", "step"),
    ("pipeline/async_pipeline.py", "_take"),
    ("pipeline/async_pipeline.py", "_deliver_all"),
    ("engine/stages/text_admission.py", "add"),
    ("engine/stages/text_admission.py", "turn"),
    ("engine/stages/encoders.py", "encode_many"),
    ("engine/scheduler.py", "schedule"),
    ("engine/scheduler.py", "update"),
    ("engine/stages/token_runner.py", "prepare"),
    ("engine/stages/token_runner.py", "execute"),
    ("engine/stages/token_runner.py", "_merge_multimodal"),
    ("engine/stages/text.py", "_sample_ahead"),
    ("engine/decode_ahead.py", "settle"),
    ("engine/stages/text.py", "_apply_token"),
    ("engine/output_processor.py", "request_output"),
]
# how often the threads' CPU times are read while the steps run (a read walks /proc for every thread)
READ_CPU_S = 0.25


def _thread_kind(name: str) -> str:
    return re.sub(r"[_-]\d+$", "*", name)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each live thread of this process: its kind and its CPU seconds (user + system) so far."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = _thread_kind(names.get(int(tid), "other (not Python)"))
        cpu[int(tid)] = (kind, (int(fields[11]) + int(fields[12])) / tick)
    return cpu


def cpu_between(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by kind of thread between two readings (a thread born in between from zero)."""
    spent: dict[str, float] = {}
    for tid, (kind, seconds) in end.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - start.get(tid, (kind, 0.0))[1]
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


class EngineProfile:
    """cProfile on the engine's thread from the first admission to the end of its loop, and the counts."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()
        self.started: float | None = None
        self.ended: float | None = None
        self.cpu_start: dict[int, tuple[str, float]] = {}
        self.cpu_end: dict[int, tuple[str, float]] = {}
        self.steps = 0
        self.requests = 0
        self.last_step = 0.0
        self.last_read = 0.0  # when the threads' CPU was last read
        self.admitted = False  # a text stage admitted its first request

    def install(self) -> None:
        add, run, step = TextAdmission.add, StepLoop.run, StepLoop.step
        me = self

        def counted_add(admission: TextAdmission, requests: list[Any]) -> list[Exception | None]:
            me.admitted = True
            me.requests += me.started is not None and len(requests)
            return add(admission, requests)

        def counted_step(loop: StepLoop) -> None:
            # from the step after the first admission on: a frame entered before cProfile starts (the loop's
            # `handle` then) would be timed from its start, not from its call
            if me.admitted and me.started is None:
                me.cpu_start = thread_cpu()
                me.started = time.perf_counter()
                me.profile.enable()
            step(loop)
            if me.started is not None and me.ended is None:
                me.steps += 1
                me.last_step = time.perf_counter()
                if me.last_step - me.last_read > READ_CPU_S:  # the threads' CPU, read until the last step
                    me.cpu_end, me.last_read = thread_cpu(), me.last_step

        def profiled_run(loop: StepLoop, *args: Any, **kwargs: Any) -> None:
            try:
                run(loop, *args, **kwargs)
            finally:
                if me.started is not None and me.ended is None:
                    me.profile.disable()
                    me.ended = me.last_step

        TextAdmission.add = counted_add  # type: ignore[method-assign]
        StepLoop.step = counted_step  # type: ignore[method-assign]
        StepLoop.run = profiled_run  # type: ignore[method-assign]

    def report(self, top: int) -> dict[str, Any]:
        assert self.started is not None and self.ended is not None
        wall = self.ended - self.started
        steps = max(self.steps, 1)
        stats = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
        rows = []
        for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
            where = path.rsplit("omnistage/", 1)[-1] if "/omnistage/" in path else path.rsplit("/", 1)[-1]
            rows.append(
                {
                    "where": f"{where}:{line}",
                    "function": name,
                    "calls": calls,
                    "own_s": own,
                    "cumulative_s": cumulative,
                }
            )
        own = sorted(rows, key=lambda r: -r["own_s"])[:top]
        main = [
            r
            for r in rows
            for suffix, name in MAIN_CALLS
            if r["function"] == name and r["where"].startswith(suffix)
        ]
        main.sort(key=lambda r: -r["cumulative_s"])
        cpu = {k: round(v, 3) for k, v in cpu_between(self.cpu_start, self.cpu_end).items()}
        return {
            "wall_s": wall,
            "steps": self.steps,
            "requests": self.requests,
            "own": own,
            "main": main,
            "thread_cpu_s": cpu,
            "per_step_us": {f"{r['where']} {r['function']}": 1e6 * r["cumulative_s"] / steps for r in main},
        }


def print_report(report: dict[str, Any]) -> None:
    steps = max(report["steps"], 1)
    print(
        f"profiled {report['wall_s']:.2f} s of the engine's thread: {report['steps']} steps, "
        f"{report['requests']} requests admitted ({1e3 * report['wall_s'] / steps:.2f} ms a step)"
    )
    print("\nthe engine's main calls, cumulative | µs a step | calls")
    for r in report["main"]:
        print(f"  {r['where']} {r['function']} | {1e6 * r['cumulative_s'] / steps:9.1f} | {r['calls']}")
    print("\nmost own time (waits included) | µs a step | calls")
    for r in report["own"]:
        print(f"  {r['where']} {r['function']} | {1e6 * r['own_s'] / steps:9.1f} | {r['calls']}")
    print(
        f"\nthread CPU seconds over the {report['wall_s']:.2f} s profiled (read to within {READ_CPU_S} s of the end)"
    )
    for kind, seconds in report["thread_cpu_s"].items():
        print(f"  {kind}: {seconds:.2f} ({100 * seconds / report['wall_s']:.0f}% of the wall time)")


def main() -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--out", required=True, help="JSON file of the report")
    parser.add_argument("--top", type=int, default=30, help="functions by own time printed")
    args = parser.parse_args()
    command = command_of(args)
    profile = EngineProfile()
    profile.install()
    failure = run(command)
    if profile.started is None or profile.ended is None:
        print("no request reached a text stage: nothing profiled")
    else:
        report = profile.report(args.top)
        with open(args.out, "w") as f:
            json.dump({"command": command, **report}, f, indent=1)
        print_report(report)
    reraise(failure)


if __name__ == "__main__":
    main()
