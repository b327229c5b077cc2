"""Memory-aware capture planning for every stage on a device: the split of the device's memory between the
floor, KV pages and the CUDA graphs of all the stages placed there. Plain arithmetic over measured numbers
(bytes), so it is unit-tested without a GPU: each stage measures what it needs (`memory.measure`), the pipeline
plans each device once for all its stages (`pipeline/planning.py`) and every stage takes what it was granted.

What each stage brings to the plan of its device is a `StageMemory`: what it holds for good (weights), the
measured eager peaks of its largest steps, its KV pool (`KVPool`) and its candidate graph sets
(`GraphCandidates`: bucket -> measured bytes). `plan_device` plans one device from them; the two-GPU topology
is two such plans (Thinker and encoders on one device, Talker, code predictor and Code2Wav on the other).

The order of claims on a device's memory:
1. what is loaded there (every stage's weights), measured as the bytes allocated;
2. the floor: the largest measured eager peak of any stage's worst step (a text prefill chunk, an encoder on
   the largest input the processor admits, a Talker prefill, a full Code2Wav call). Steps of different stages
   take turns on a device, so only the largest needs room, and it is always there: no request runs out;
3. a reserve for what the measurements do not see;
4. each KV pool's minimum, one request of its stage's longest length (or the pages the config fixes): a graph
   never takes the memory one request needs;
5. CUDA graphs, within a budget (default: all that is left). A graph is priced at what its step keeps (its
   outputs and static buffers) plus what its memory pool's scratch must grow by for it: the graphs of one
   pool, replayed one at a time, share their scratch (a set that does not measure what it keeps is priced
   at its whole peak). First the sets replayed on every
   generated step (kind "decode": Thinker and Talker decode, code predictor frames, Code2Wav chunks), then
   those replayed once per prompt chunk or input (kind "prefill": prefill chunks, audio windows, vision
   patches). A decode-kind step recurs for every token or frame of every request and is small, so its
   launches are what an eager step loses; a prefill-kind step comes once beside work that hides them. Within
   a kind, buckets are taken cheapest first across all the stages (the most graphs for the budget), each
   bucket whole or not at all (a graph holds all its slots);
6. every byte left to KV pages: a pool with a `share` gets that share of it, the pool without one the rest.
What is not captured runs eagerly; the plan says which buckets, per stage.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from omnistage.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

# Covers allocator fragmentation, cuBLAS/NCCL workspaces and Triton's launch scratch that the floor
# measurement does not see. A guess until benchmarks/RESULTS.md measures it.
DEFAULT_RESERVE = 512 * MiB

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
    pages: fixed by the config, exactly this many (claimed instead of `min_pages`).
    """

    stage: str
    bytes_per_page: int
    min_pages: int
    share: float | None = None
    pages: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_page < 1:
            raise ValueError(f"{self.stage}: bytes_per_page must be positive, got {self.bytes_per_page}")
        if self.min_pages < 0 or (self.pages is not None and self.pages < 1):
            raise ValueError(f"{self.stage}: min_pages must be >= 0 and pages >= 1")
        if self.share is not None and not 0 < self.share <= 1:
            raise ValueError(f"{self.stage}: a KV share is within (0, 1], got {self.share}")
        if self.share is not None and self.pages is not None:
            raise ValueError(f"{self.stage}: give a KV pool a share or fixed pages, not both")

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


def plan_device(
    device: DeviceMemory,
    stages: Sequence[StageMemory],
    reserve: int = DEFAULT_RESERVE,
    graph_budget: int | None = None,
) -> MemoryPlan:
    """Split what `device` has left after loading between the floor, the reserve, KV pages and CUDA graphs of
    every stage on it (the order of claims is in the module's docstring).

    graph_budget: bytes graphs may take (default: all that the floor, the reserve and the pools' minimums
    leave). Raises ConfigError, naming the stages' needs, when they do not fit.
    """
    resident = tuple(row for s in stages for row in s.resident)
    phases = tuple(row for s in stages for row in s.peaks)
    pools = [pool for s in stages for pool in s.kv]
    sets = [g for s in stages for g in s.graphs]
    _check(pools, sets)
    floor = max((size for _, size, _ in phases), default=0)
    needed = floor + reserve + sum(p.required * p.bytes_per_page for p in pools)
    available = device.available
    if available < needed:
        raise ConfigError(_does_not_fit(device, phases, floor, reserve, pools))
    spare = available - needed
    budget = spare if graph_budget is None else graph_budget
    graphs = tuple(
        GraphPlan(c, captured, paid)
        for c, (captured, paid) in zip(sets, _claim(sets, max(0, min(budget, spare))), strict=True)
    )
    kv = _size_pools(pools, spare - sum(g.bytes for g in graphs))
    return MemoryPlan(
        device=device,
        floor=floor,
        reserve=reserve,
        kv=kv,
        graphs=graphs,
        free=available - floor - reserve - sum(g.bytes for g in graphs) - sum(k.bytes for k in kv),
        phases=phases,
        resident=resident,
    )


def _check(pools: list[KVPool], sets: list[GraphCandidates]) -> None:
    stages = [p.stage for p in pools]
    if len(set(stages)) < len(stages):
        raise ValueError(f"one KV pool per stage, got {stages}")
    rest = [p.stage for p in pools if p.share is None and p.pages is None]
    if len(rest) > 1:
        raise ValueError(f"only one KV pool may take what the shares leave; give the others a share: {rest}")
    if sum(p.share or 0 for p in pools) > 1:
        raise ValueError(
            f"the KV shares add up to more than 1: {[(p.stage, p.share) for p in pools if p.share]}"
        )
    labels = [g.label for g in sets]
    if len(set(labels)) < len(labels):
        raise ValueError(f"one graph set per stage and kind, got {labels}")


def _claim(sets: list[GraphCandidates], budget: int) -> list[tuple[tuple[Bucket, ...], int]]:
    """Per set, the buckets taken (ascending) and the bytes paid for them: by kind in KINDS' order, cheapest
    first across the sets of the kind (ties: the set listed first, then the smaller bucket), each while it
    fits `budget` whole. A bucket's price is what it keeps plus what its pool's scratch must grow by for it
    (GraphCandidates): prices only fall as a pool's scratch grows, so when the cheapest does not fit, none do."""
    taken: list[list[Bucket]] = [[] for _ in sets]
    paid = [0] * len(sets)
    scratch: dict[str, int] = {}  # per pool: the largest scratch of the graphs taken into it
    used = 0

    def price(i: int, bucket: Bucket) -> int:
        kept, own = sets[i].split(bucket)
        return kept + max(0, own - scratch.get(sets[i].pool_name, 0))

    for kind in KINDS:
        offers = [(i, bucket) for i, c in enumerate(sets) if c.kind == kind for bucket in c.costs]
        while offers:
            # buckets are compared only within a set (same price and index), where they are of one type
            cost, i, bucket = min((price(i, b), i, b) for i, b in offers)
            if used + cost > budget:
                break
            offers.remove((i, bucket))
            taken[i].append(bucket)
            paid[i] += cost
            used += cost
            pool = sets[i].pool_name
            scratch[pool] = max(scratch.get(pool, 0), sets[i].split(bucket)[1])
    return [(tuple(sorted(buckets)), cost) for buckets, cost in zip(taken, paid)]


def _size_pools(pools: list[KVPool], extra: int) -> tuple[KVPlan, ...]:
    """Each pool's pages: fixed, or its minimum and its share of `extra` (the bytes beyond every pool's
    minimum), the pool without a share its minimum and what the shares leave."""
    shared = {p.stage: int(p.share * extra) // p.bytes_per_page for p in pools if p.share is not None}
    left = extra - sum(shared[p.stage] * p.bytes_per_page for p in pools if p.share is not None)
    plans = []
    for pool in pools:
        if pool.pages is not None:
            pages = pool.pages
        elif pool.share is not None:
            pages = pool.min_pages + shared[pool.stage]
        else:
            pages = pool.min_pages + left // pool.bytes_per_page
        plans.append(KVPlan(pool, pages))
    return tuple(plans)


def _does_not_fit(
    device: DeviceMemory, phases: tuple[Row, ...], floor: int, reserve: int, pools: list[KVPool]
) -> str:
    cap = (
        f"gpu_memory_limit {device.limit / GiB:.2f} GiB"
        if device.limit is not None
        else f"{device.total / GiB:.2f} GiB"
    )
    largest = f" (the {max(phases, key=lambda row: row[1])[0]})" if phases else ""
    kv = "".join(
        f" + {p.stage} KV {p.required * p.bytes_per_page / GiB:.2f} GiB ({p.required:,} "
        f"page{'s' if p.required > 1 else ''} {'asked for' if p.pages is not None else 'for one request'})"
        for p in pools
        if p.required
    )
    needed = device.allocated + floor + reserve + sum(p.required * p.bytes_per_page for p in pools)
    return (
        f"the stages on {device.name} do not fit in {cap}: weights {device.allocated / GiB:.2f} GiB + floor "
        f"{floor / GiB:.2f} GiB{largest} + reserve {reserve / GiB:.2f} GiB{kv} = {needed / GiB:.2f} GiB, but "
        f"only {(device.allocated + max(device.available, 0)) / GiB:.2f} GiB is available "
        f"({device.free / GiB:.2f} GiB free after loading)"
    )


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
