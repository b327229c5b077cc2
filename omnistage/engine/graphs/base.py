"""GraphSet: one captured CUDA graph per bucket of a step over static buffers.

The graphs are for the steps whose host work outweighs their GPU work (a decode batch, a short prefill, a
code-predictor frame, a Code2Wav chunk, an encoder call). A stage's set holds static buffers sized for its
largest bucket; a call is copied into their leading rows and padded to the bucket, and the bucket's graph
replays. Off CUDA, `capture` binds eager calls over the same static buffers, so the padding paths are tested
on the CPU; only the graph capture itself needs a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import torch
from tqdm import tqdm

from omnistage.engine.buckets import bucket_for, faster_buckets
from omnistage.engine.memory.measure import Peak, device_peak, scaled_peaks

logger = logging.getLogger(__name__)

TIMED_REPLAYS = 5  # per bucket, after one untimed, when a set routes batches by measured speed

StepFn = Callable[..., Any]
# A bucket is its size in the set's unit, or, in a set of several shapes (Code2Wav's (chunk frames, streams)),
# a tuple whose last item is its size and whose leading items name its group: a group's sizes are one ladder.
Bucket = int | tuple[int, ...]


def int_buckets(buckets: Iterable[Bucket]) -> list[int]:
    """The buckets of a set keyed by one count (a batch, tokens, windows, patches), as the ints they are."""
    return [b for b in buckets if isinstance(b, int)]


def size_of(bucket: Bucket) -> int:
    return bucket if isinstance(bucket, int) else bucket[-1]


def group_of(bucket: Bucket) -> tuple[int, ...]:
    return () if isinstance(bucket, int) else bucket[:-1]


def bucket_in(group: tuple[int, ...], size: int) -> Bucket:
    return (*group, size) if group else size


def groups(buckets: Iterable[Bucket]) -> dict[tuple[int, ...], list[Bucket]]:
    """Buckets by group, largest group first (as captured), each group's buckets ascending."""
    grouped: dict[tuple[int, ...], list[Bucket]] = {}
    for bucket in sorted(set(buckets), reverse=True):
        grouped.setdefault(group_of(bucket), []).insert(0, bucket)
    return grouped


class Buffers(Protocol):
    """A step's static inputs, sized for a set's largest bucket; a bucket uses their leading part. (Buckets
    are typed Any here so that a set of int buckets may say `int`.)"""

    capacity: int  # the largest bucket size they hold, in the set's unit

    def args(self, bucket: Any) -> tuple:
        """The step's arguments for a graph of `bucket`: views of the buffers, the same tensors every call."""
        ...

    def clear(self, bucket: Any) -> None:
        """Make `bucket`'s part padding (before warm-up, capture and timing: a step over it changes no state)."""
        ...

    def fill(self, *args: Any, **kwargs: Any) -> Any:
        """`fill(*inputs, bucket)`: copy a call's inputs into the leading rows and pad the rest of `bucket`
        (device copies, no sync)."""
        ...


B = TypeVar("B", bound=Buffers)


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every graph set of `device` captures on. Not torch.cuda.graph's default, which is made once
    per process on the device current at the first capture: with stages on two GPUs a set on the other one
    would capture on a foreign stream (its kernels then not captured, its allocations refused). One stream for
    all the sets of a device, as the caching allocator gives a pool's freed blocks only to allocations on the
    stream that freed them: the sets sharing a pool share their scratch only if captured on one stream."""
    return _capture_stream(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capture_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


class GraphSet(Generic[B]):
    """One captured graph per bucket of a step function over static buffers (`buffers.args(bucket)`).

    `replay(bucket, *inputs)` is the one way a call reaches a graph: a set's `run` (or `__call__`) picks the
    bucket, or runs eagerly where none fits, and takes its rows of what `replay` returns. Graphs are captured
    largest first into one memory pool, which the smaller ones (and other sets given the same `pool`) reuse:
    only one step runs at a time. A set with `route_by_speed` times each bucket's replay after capture and
    sends a batch to a larger bucket whose graph replays faster (`buckets.faster_buckets`); `routes` holds
    what it chose. `on_replay`, when set, is called with each bucket `replay` replays (tests, traces).
    """

    kind = "step"
    unit = "rows"
    route_by_speed = False
    scaled_costs = True  # `graph_peaks` measures a group's largest bucket and scales the others by size

    def __init__(self, step: StepFn, buffers: B, device: torch.device | str, enforce_eager: bool = False):
        self.step = step
        self.buffers = buffers
        self.device = torch.device(device)
        self.enforce_eager = enforce_eager
        self.on_replay: Callable[[Bucket], None] | None = None
        self._replays: dict[Bucket, Callable[[], None]] = {}
        self._outputs: dict[Bucket, Any] = {}
        self._graphs: list[Any] = []
        self.pool: Any = None
        self.graph_bytes: dict[Bucket, int] = {}
        self.replay_ms: dict[Bucket, float] = {}
        self.routes: dict[Bucket, Bucket] = {}

    @property
    def captured_buckets(self) -> list[Bucket]:
        return sorted(self._replays)

    @property
    def graph_count(self) -> int:
        """CUDA graphs captured (off CUDA none: the buckets replay static-eager calls)."""
        return len(self._graphs)

    def bucket_for(self, size: int, group: tuple[int, ...] = ()) -> Bucket | None:
        """The captured bucket a call of `size` replays (of `group`, for tuple buckets): the smallest that
        holds it, or the larger one measured faster (`routes`); None when none holds it."""
        if self.enforce_eager:
            return None
        fitting = bucket_for(size, [size_of(b) for b in self._replays if group_of(b) == group])
        if fitting is None:
            return None
        bucket = bucket_in(group, fitting)
        return self.routes.get(bucket, bucket)

    def routes_note(self) -> str:
        """The routes that pad to a larger bucket, for the start-up summary ("" when none does)."""
        moved = [(b, r) for b, r in sorted(self.routes.items()) if r != b]
        if not moved:
            return ""
        return " (" + ", ".join(f"{b} replays {r}" for b, r in moved) + ": measured faster)"

    def replay(self, bucket: Bucket, *inputs: Any) -> Any:
        """Fill the buffers with a call's `inputs` for `bucket` (none given: replay what they hold), replay the
        bucket's graph (off CUDA its static-eager call) and return the bucket's outputs: static tensors, which
        the next replay of any graph of the pool may overwrite."""
        if inputs:
            self.buffers.fill(*inputs, bucket)
        if self.on_replay is not None:
            self.on_replay(bucket)
        self._replays[bucket]()
        return self._outputs[bucket]

    def graph_costs(self, buckets: Iterable[Bucket]) -> dict[Bucket, Peak]:
        """What capturing each of `buckets` costs the memory plan, measured before capture over this set's
        buffers (`graph_peaks`); {} off CUDA or eager, where nothing is captured."""
        if self.device.type != "cuda" or self.enforce_eager:
            return {}
        return graph_peaks(lambda _: self, buckets, self.device, self.scaled_costs)

    def capture(self, buckets: Iterable[Bucket], pool: Any = None) -> list[Bucket]:
        """Capture one graph per bucket, largest first; records each capture's added bytes in `graph_bytes`."""
        buckets = sorted(set(buckets), reverse=True)
        if self.enforce_eager or not buckets:
            return []
        largest = max(buckets, key=size_of)
        if size_of(largest) > self.buffers.capacity:
            raise ValueError(
                f"bucket {largest} exceeds the static buffers' {self.buffers.capacity} {self.unit}"
            )
        start = time.perf_counter()
        if self.device.type != "cuda":
            for bucket in buckets:
                self._replays[bucket] = self._static_eager(bucket)
            return sorted(buckets)
        self._warm_up(buckets)
        self.pool = pool or self.pool or torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        for bucket in tqdm(buckets, desc=f"capturing {self.kind} graphs", unit="graph"):
            # what torch.cuda.graph does on entering; done before measuring, the cached blocks it frees (the
            # warm-up's) are not taken off what the capture adds
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
            self.buffers.clear(bucket)
            graph = torch.cuda.CUDAGraph()
            # capturing on `stream` also makes its device the current one
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._outputs[bucket] = self.step(*self.buffers.args(bucket))
            self._graphs.append(graph)
            self._replays[bucket] = graph.replay
            self.graph_bytes[bucket] = torch.cuda.memory_reserved(self.device) - before
        torch.cuda.synchronize(self.device)
        if self.route_by_speed:
            with torch.cuda.device(self.device):  # the events' stream: the one the graphs replay on
                self.replay_ms = self.time_replays(buckets)
            routes: dict[Bucket, Bucket] = {}
            for group, members in groups(buckets).items():  # a group's buckets are one ladder of sizes
                faster = faster_buckets({size_of(b): self.replay_ms[b] for b in members})
                routes |= {bucket_in(group, b): bucket_in(group, r) for b, r in faster.items()}
            self.routes = routes
        logger.info(
            "captured %d %s graphs (%s %s..%s) in %.1f s%s",
            len(buckets), self.kind, self.unit, buckets[-1], buckets[0], time.perf_counter() - start,
            self.routes_note(),
        )  # fmt: skip
        return sorted(buckets)

    def time_replays(self, buckets: Iterable[Bucket]) -> dict[Bucket, float]:
        """Milliseconds of one replay per captured bucket, over padding rows (as captured: they touch no state;
        CUDA only)."""
        times = {}
        for bucket in buckets:
            self.buffers.clear(bucket)
            replay = self._replays[bucket]
            replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(TIMED_REPLAYS):
                replay()
            end.record()
            end.synchronize()
            times[bucket] = start.elapsed_time(end) / TIMED_REPLAYS
        return times

    def _static_eager(self, bucket: Bucket) -> Callable[[], None]:
        def replay() -> None:
            self._outputs[bucket] = self.step(*self.buffers.args(bucket))

        return replay

    def _warm_up(self, buckets: list[Bucket]) -> None:
        """Every bucket's step once over its own padding (`clear`), as it will be captured. cuBLAS creates its
        handle and workspace, and Triton compiles a kernel per shape class, on first use; graph capture cannot
        record either, so on a GPU this runs on a side stream first. Each bucket is cleared for itself: a
        larger bucket's padding is not a smaller one's (the audio buffers' segment bounds of the largest pass
        a smaller bucket's rows, and FlashAttention read past them)."""
        on_gpu = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if on_gpu else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # None (off CUDA): no stream, the steps run here
            for b in buckets:
                self.buffers.clear(b)
                self.step(*self.buffers.args(b))
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)


def graph_peaks(
    make: Callable[[Bucket], GraphSet], buckets: Iterable[Bucket], device: torch.device, scaled: bool = True
) -> dict[Bucket, Peak]:
    """What a graph of each bucket takes, measured the one way (GPU only): the peak of the bucket's eager step
    over the static buffers of the set `make(bucket)` gives, from an empty cache (`memory.measure.device_peak`),
    and what the step keeps (its outputs: a graph keeps them; the rest is scratch its pool shares). `make`
    returns the set itself, or builds one for the bucket alone where the set is made only at capture: its
    buffers are then counted among what the graph keeps. `scaled`: each group's largest bucket is measured
    and the others scaled by size (`scaled_peaks`: steps whose memory grows with their rows); else every
    bucket is measured (the encoder towers, whose scratch does not)."""
    peaks: dict[Bucket, Peak] = {}
    for members in groups(buckets).values():
        measured = {b: _peak(make, b, device) for b in (members[-1:] if scaled else members)}
        if scaled:
            by_size = scaled_peaks(measured[members[-1]], [size_of(b) for b in members])
            measured = {b: by_size[size_of(b)] for b in members}
        peaks |= measured
    return peaks


def _peak(make: Callable[[Bucket], GraphSet], bucket: Bucket, device: torch.device) -> Peak:
    with torch.inference_mode(), device_peak(device) as peak:
        graphs = make(bucket)
        graphs.buffers.clear(bucket)
        out = graphs.step(*graphs.buffers.args(bucket))
    del graphs, out
    torch.cuda.empty_cache()
    return peak
