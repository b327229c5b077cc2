"""Memory-aware capture planning for every stage on a device: the split of the device's memory between the
floor, KV pages and the CUDA graphs of all the stages placed there. Plain arithmetic over measured numbers
(bytes), so it is unit-tested without a GPU: each stage measures what it needs (`memory.measure`), the pipeline
plans each device once for all its stages (`pipeline/planning.py`) and every stage takes what it was granted.

What each stage brings to the plan of its device is a `StageMemory`: what it holds for good (weights), the
measured eager peaks of its largest steps, its KV pool (`KVPool`) and its candidate graph sets
(`GraphCandidates`: bucket -> measured bytes). `plan_device` plans one device from them; the two-GPU topology
is two such plans (Thinker and encoders on one device, Talker, code predictor and Code2Wav on the other).

The plan is made by `memory.planner.plan_device`; its order of claims is in that module's docstring.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

GiB = 1 << 30
MiB = 1 << 20

# Covers allocator fragmentation, cuBLAS/NCCL workspaces and Triton's launch scratch that the floor
# measurement does not see. A guess until benchmarks/RESULTS.md measures it.
DEFAULT_RESERVE = 512 * MiB
# tokens: the shortest request a pool whose longest length is the model's own keeps room for when it shrinks
LEAST_CONTEXT = 8192


def least_pages(longest: int, page_size: int) -> int:
    """`KVPool.least_pages` of a pool whose longest request (`longest` tokens) is the model's own length."""
    return -(-min(LEAST_CONTEXT, longest) // page_size)


# The graph memory pool of the sets that replay on a device's main stream, one graph at a time: the Thinker's
# prefill chunks, the encoders and the speech stages share their scratch in it. The Thinker's decode graphs
# keep a pool of their own: with overlap_stages they replay on a stream of their own beside the speech stages
# (pipeline/side_stream.py), and two graphs running at once must not share scratch.
MAIN_POOL = "main stream"

Row = tuple[str, int, str]  # (name, bytes, what): one line of the plan
Bucket = int | tuple[int, ...]  # a batch or token count, or e.g. Code2Wav's (chunk frames, streams)
GraphKind = Literal["decode", "prefill"]
KINDS: tuple[GraphKind, ...] = ("decode", "prefill")  # the order in which they claim the graph budget


def scaled_costs(largest_peak: int, buckets: list[int]) -> dict[int, int]:
    """Graph memory per bucket: the largest bucket's measured step peak scaled by size, plus 2 MiB."""
    return {b: -(-largest_peak * b // max(buckets)) + (2 << 20) for b in buckets}


@dataclass(frozen=True)
class GraphCandidates:
    """One stage's CUDA graphs to choose from: each bucket with the bytes its step takes at its peak (measured,
    e.g. by a graph runner's `graph_costs`). `kind` says when a graph replays (see the module's docstring),
    `unit` what a bucket counts (batch, tokens, frames, windows, patches, chunk x streams).

    `pool`: the graph memory pool the set is captured into (default: one of its own). A graph keeps in its
    pool what its step still holds at the end (`kept`: its outputs and static buffers; default: all of its
    peak); the rest is scratch, which the graphs of one pool, replayed one at a time, share: a pool costs the
    sum of what its graphs keep plus the largest scratch of any of them."""

    stage: str
    kind: GraphKind
    unit: str
    costs: Mapping[Bucket, int]
    pool: str = ""
    kept: Mapping[Bucket, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.stage}: graph kind must be one of {KINDS}, got {self.kind!r}")
        bad = [b for b, cost in self.costs.items() if cost < 0]
        if bad:
            raise ValueError(f"{self.stage} {self.kind}: negative graph costs for buckets {bad}")
        if self.kept is not None and (
            set(self.kept) != set(self.costs)
            or any(not 0 <= self.kept[b] <= c for b, c in self.costs.items())
        ):
            raise ValueError(
                f"{self.stage} {self.kind}: kept bytes must be given per bucket, within its cost"
            )

    @property
    def label(self) -> str:
        return f"{self.stage} {self.kind}"

    @property
    def pool_name(self) -> str:
        return self.pool or self.label

    def split(self, bucket: Bucket) -> tuple[int, int]:
        """(kept, scratch) bytes of a bucket's graph."""
        kept = self.costs[bucket] if self.kept is None else self.kept[bucket]
        return kept, self.costs[bucket] - kept


@dataclass(frozen=True)
class KVPool:
    """One stage's KV page pool, sized by the plan of its device.

    min_pages: one request of the stage's longest length, claimed before any graph; share: of the KV memory
    beyond every pool's minimum (the pool without a share takes what the shares leave; at most one such pool);
    pages: fixed by the config, exactly this many (claimed instead of `min_pages`); least_pages: where the
    longest length is the model's own (the config sets none), the fewest pages `min_pages` may shrink to when
    one request of that length does not fit beside the weights and the graphs (`planner.plan_device`); None: it
    may not.
    """

    stage: str
    bytes_per_page: int
    min_pages: int
    share: float | None = None
    pages: int | None = None
    least_pages: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_page < 1:
            raise ValueError(f"{self.stage}: bytes_per_page must be positive, got {self.bytes_per_page}")
        if self.min_pages < 0 or (self.pages is not None and self.pages < 1):
            raise ValueError(f"{self.stage}: min_pages must be >= 0 and pages >= 1")
        if self.share is not None and not 0 < self.share <= 1:
            raise ValueError(f"{self.stage}: a KV share is within (0, 1], got {self.share}")
        if self.share is not None and self.pages is not None:
            raise ValueError(f"{self.stage}: give a KV pool a share or fixed pages, not both")
        if self.least_pages is not None and not 1 <= self.least_pages <= max(self.min_pages, 1):
            raise ValueError(f"{self.stage}: least_pages is within [1, min_pages], got {self.least_pages}")

    @property
    def required(self) -> int:
        """Pages claimed before any graph."""
        return self.pages if self.pages is not None else self.min_pages


@dataclass(frozen=True)
class StageMemory:
    """What stages bring to the plan of their device: what they hold for good (`resident`: weights, fixed
    buffers; within the device's allocated bytes), the measured eager peaks of their largest steps (`peaks`),
    each (name, bytes, what), their KV pools to size and their candidate graph sets."""

    resident: tuple[Row, ...] = ()
    peaks: tuple[Row, ...] = ()
    kv: tuple[KVPool, ...] = ()
    graphs: tuple[GraphCandidates, ...] = ()


NO_OTHER_STAGES = StageMemory()


@dataclass(frozen=True)
class DeviceMemory:
    """What a device offers this process once every stage placed on it is loaded. Bytes."""

    total: int  # the device's memory
    free: int  # free on the device after loading (`torch.cuda.mem_get_info`: other processes already out)
    allocated: int  # what this process holds there: every stage's weights and resident buffers
    limit: int | None = None  # gpu_memory_limit: a cap on all this process holds there, `allocated` included
    name: str = "cuda"

    @property
    def available(self) -> int:
        """Bytes the plan may give beyond what is allocated."""
        return self.free if self.limit is None else min(self.free, self.limit - self.allocated)


@dataclass(frozen=True)
class GraphPlan:
    """What the plan decided for one candidate set: the buckets to capture (the others run eagerly), and the
    bytes the plan gave them (what they keep, and the scratch their pool grew by for them)."""

    candidates: GraphCandidates
    captured: tuple[Bucket, ...]  # ascending
    bytes: int

    @property
    def eager(self) -> tuple[Bucket, ...]:
        return tuple(sorted(set(self.candidates.costs) - set(self.captured)))


@dataclass(frozen=True)
class KVPlan:
    pool: KVPool
    pages: int

    @property
    def bytes(self) -> int:
        return self.pages * self.pool.bytes_per_page


@dataclass(frozen=True)
class MemoryPlan:
    """How one device's memory is split between the stages placed on it. Every size in bytes."""

    device: DeviceMemory
    floor: int  # the largest of `phases`: measured eager peak of the largest step, beyond the weights
    reserve: int
    kv: tuple[KVPlan, ...]  # per stage
    graphs: tuple[GraphPlan, ...]  # per candidate set
    free: int  # beyond the reserve: less than a page when a pool takes the rest
    phases: tuple[Row, ...] = ()  # every stage's largest steps
    resident: tuple[Row, ...] = ()  # what the weights are: each stage's, as the stages report them

    @property
    def total(self) -> int:
        """What the device (or gpu_memory_limit) offers this process."""
        return self.device.total if self.device.limit is None else min(self.device.total, self.device.limit)

    @property
    def weights(self) -> int:
        return self.device.allocated

    @property
    def limit(self) -> int | None:
        return self.device.limit

    @property
    def kv_bytes(self) -> int:
        return sum(kv.bytes for kv in self.kv)

    @property
    def graph_bytes(self) -> int:
        return sum(g.bytes for g in self.graphs)

    def kv_pool(self, stage: str) -> KVPlan:
        for kv in self.kv:
            if kv.pool.stage == stage:
                return kv
        raise KeyError(f"no KV pool of {stage!r} in the plan of {self.device.name}")

    def graph_set(self, stage: str, kind: GraphKind) -> GraphPlan | None:
        return next(
            (g for g in self.graphs if (g.candidates.stage, g.candidates.kind) == (stage, kind)), None
        )

    def captured(self, stage: str, kind: GraphKind) -> tuple[Bucket, ...]:
        """The buckets of `stage`'s `kind` set to capture (ascending); empty when it has none."""
        graphs = self.graph_set(stage, kind)
        return graphs.captured if graphs else ()

    def table(self) -> str:
        """The plan per part and per stage: weights, KV pages, CUDA graphs, the floor's phases, reserve, free."""
        rows: list[Row] = [("weights", self.weights, "")]
        if self.resident:
            rows += [(f"  {name}", size, note) for name, size, note in self.resident]
            other = self.weights - sum(size for _, size, _ in self.resident)
            if other > 0:
                rows.append(("  other allocations", other, "buffers and tables the stages do not list"))
        kv_notes = [
            f"{kv.pages:,} pages × {kv.pool.bytes_per_page / MiB:.2f} MiB{_kv_terms(kv.pool)}"
            for kv in self.kv
        ]
        if len(self.kv) == 1:
            rows.append(("KV pages", self.kv_bytes, f"{self.kv[0].pool.stage}: {kv_notes[0]}"))
        else:
            rows.append(("KV pages", self.kv_bytes, ""))
            rows += [
                (f"  {kv.pool.stage}", kv.bytes, note) for kv, note in zip(self.kv, kv_notes, strict=True)
            ]
        captured = sum(len(g.captured) for g in self.graphs)
        candidates = sum(len(g.candidates.costs) for g in self.graphs)
        rows.append(
            ("CUDA graphs", self.graph_bytes, f"{captured}/{candidates} buckets" if self.graphs else "none")
        )
        rows += [(f"  {g.candidates.label}", g.bytes, _graph_note(g)) for g in self.graphs]
        rows.append(("floor (eager peak)", self.floor, "the largest of:" if len(self.phases) > 1 else ""))
        if len(self.phases) > 1:
            rows += [(f"  {name}", size, note) for name, size, note in self.phases]
        rows += [("reserve", self.reserve, ""), ("free", self.free, "")]
        budget = "gpu_memory_limit" if self.limit is not None else "device"
        lines = [f"memory plan ({budget}: {self.total / GiB:.2f} GiB) on {self.device.name}"]
        lines += [f"  {name:<26}{size / GiB:8.2f} GiB  {note}".rstrip() for name, size, note in rows]
        lines += [
            f"  eager {g.candidates.label} ({g.candidates.unit}): {', '.join(map(_bucket, g.eager))}"
            for g in self.graphs
            if g.eager
        ]
        return "\n".join(lines)


def _bucket(bucket: Bucket) -> str:
    return str(bucket) if isinstance(bucket, int) else "x".join(map(str, bucket))


def _graph_note(graphs: GraphPlan) -> str:
    captured, unit = graphs.captured, graphs.candidates.unit
    note = f"{len(captured)}/{len(graphs.candidates.costs)} {unit}"
    return note + (f" {_bucket(captured[0])}..{_bucket(captured[-1])}" if captured else "")


def _kv_terms(pool: KVPool) -> str:
    if pool.pages is not None:
        return ", fixed"
    return f", share {pool.share:.0%}" if pool.share is not None else ""


def kv_bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype_bytes: int = 2
) -> int:
    """Bytes of one page across every layer: K and V, `page_size` tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * page_size * dtype_bytes
