"""Builds while serving: each kernel or graph compiled after start-up is logged, with the time it took.

Start-up warms the step shapes traffic brings and captures the graphs, so that nothing is compiled inside a
request. Anything built later stalls the step that needs it and every request in that step: a Triton kernel
for a specialization no warm-up reached (tenths of a second), a torch.compile graph for a new guard (seconds).
`watch_compiles()` (called as serving starts) logs each one as a warning naming the kernel or the graph, so a
shape the warm-up misses shows in the log instead of as an unexplained slow request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class CompileWatch:
    """Times each build between its start and end hooks and reports it (`builds` keeps them, newest last)."""

    def __init__(self) -> None:
        self.builds: list[tuple[str, float]] = []  # (what was built, seconds)
        self._started: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._starting_up = 0  # pipelines being built (`starting_up`): their builds are start-up's

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """While a pipeline starts (e.g. a second one in a process that already serves): what it builds is
        its warm-up's and capture's, logged at debug level and not counted as built while serving."""
        with self._lock:
            self._starting_up += 1
        try:
            yield
        finally:
            with self._lock:
                self._starting_up -= 1

    def triton_started(self, *, key: Any, **_: Any) -> None:
        """Triton's jit_cache_hook: a kernel is about to be built (None: let Triton build it)."""
        with self._lock:
            self._started[("triton", repr(key))] = time.perf_counter()

    def triton_built(self, *, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> None:
        """Triton's jit_post_compile_hook."""
        self._report(f"Triton kernel {_specialization(fn.name, compile)}", ("triton", repr(key)))

    def graph_started(self, args: Any) -> None:
        """torch.compile's start callback (a frame is being traced, compiled or recorded)."""
        with self._lock:
            self._started[("graph", args.compile_id)] = time.perf_counter()

    def graph_built(self, args: Any) -> None:
        trigger = getattr(args.callback_trigger, "name", args.callback_trigger)
        self._report(f"torch.compile graph {args.compile_id} ({trigger})", ("graph", args.compile_id))

    def _report(self, what: str, key: tuple) -> None:
        now = time.perf_counter()
        with self._lock:
            seconds = now - self._started.pop(key, now)
            if self._starting_up:
                log.debug("built during a start-up, in %.0f ms: %s", seconds * 1e3, what)
                return
            self.builds.append((what, seconds))
        log.warning(
            "built while serving, in %.0f ms: %s (a shape start-up did not warm; the step waited for it)",
            seconds * 1e3,
            what,
        )


_watch: CompileWatch | None = None


def starting_up() -> contextlib.AbstractContextManager[None]:
    """`CompileWatch.starting_up` of the process's watch, where one is installed (else nothing to pause)."""
    return _watch.starting_up() if _watch is not None else contextlib.nullcontext()


def builds_while_serving() -> list[tuple[str, float]]:
    """What the process's watch has seen built since serving started (none before `watch_compiles`)."""
    return list(_watch.builds) if _watch is not None else []


def watch_compiles() -> CompileWatch:
    """Install the process's CompileWatch (once) on Triton's JIT hooks, where Triton is installed, and on
    torch.compile's callbacks; returns it."""
    global _watch
    if _watch is not None:
        return _watch
    watch = CompileWatch()
    try:
        import triton
    except ImportError:  # a CPU machine without Triton: nothing of ours is built with it
        pass
    else:
        triton.knobs.runtime.jit_cache_hook = watch.triton_started
        triton.knobs.runtime.jit_post_compile_hook = watch.triton_built
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(watch.graph_started)
    callback_handler.register_end_callback(watch.graph_built)
    _watch = watch
    return watch


def _specialization(name: str, compile: dict[str, Any]) -> str:
    """A Triton build as `name[warps, stages](constexprs; which arguments it took as 16-divisible or,
    pointers, 16-byte aligned)`: what tells one build of a kernel from another."""
    names = list(compile["signature"])
    constants = ", ".join(f"{names[path[0]]}={value}" for path, value in compile["constants"].items())
    (attrs,) = compile["configs"]
    marked = ", ".join(names[path[0]] for path in attrs) or "none"
    launch = f"num_warps={compile['num_warps']}, num_stages={compile['num_stages']}"
    return f"{name}[{launch}]({constants}; 16-divisible or aligned: {marked})"
