"""`plan_device`: one device's memory split between the floor, the reserve, KV pages and the CUDA graphs of every
stage placed there (`memory.plan` holds what the stages bring and what the plan grants).

The order of claims on a device's memory:
1. what is loaded there (every stage's weights), measured as the bytes allocated;
2. the floor: the largest measured eager peak of any stage's worst step (a text prefill chunk, an encoder on
   the largest input the processor admits, a Talker prefill, a full Code2Wav call). Steps of different stages
   take turns on a device, so only the largest needs room, and it is always there: no request runs out;
3. a reserve for what the measurements do not see;
4. each KV pool's minimum, one request of its stage's longest length (or the pages the config fixes): a graph
   never takes the memory one request needs. Where that length is the model's own (the config sets none) and
   the minimums and every graph candidate do not fit together, the minimums shrink together to leave the
   graphs their room, but to no less than half of what is left for KV and graphs (nor below each pool's
   `least_pages`): the server starts, and serves at speed (RESULTS.md, "T2S through HTTP, the colocated
   topology capped at 80 GiB"); the graphs come next, then the pools take the rest back, and admission
   refuses a request longer than its pool holds. A warning names each pool so shrunk;
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

import logging
from collections.abc import Sequence
from dataclasses import replace

from omnistage.engine.memory.plan import (
    DEFAULT_RESERVE,
    KINDS,
    Bucket,
    DeviceMemory,
    GiB,
    GraphCandidates,
    GraphPlan,
    KVPlan,
    KVPool,
    MemoryPlan,
    Row,
    StageMemory,
)
from omnistage.errors import ConfigError

log = logging.getLogger(__name__)


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
    available = device.available
    room = available - floor - reserve  # for KV pages and graphs
    every_graph = sum(paid for _, paid in _claim(sets, room if graph_budget is None else graph_budget))
    if room < _claimed(pools) + every_graph:
        shrunk = _shrink(pools, max(room // 2, room - every_graph))
        if room < _claimed(shrunk):
            raise ConfigError(_does_not_fit(device, phases, floor, reserve, pools))
        for before, after in zip(pools, shrunk, strict=True):
            if after.min_pages < before.min_pages:
                log.warning(
                    "%s: one request of the model's longest length needs %s KV pages, more than fit beside "
                    "the weights and the CUDA graphs of serving on %s; the plan claims %s first and admission "
                    "refuses requests longer than the pool (set --max-model-len, or give the server more memory)",
                    before.stage, f"{before.min_pages:,}", device.name, f"{after.min_pages:,}",
                )  # fmt: skip
        pools = shrunk
    needed = floor + reserve + _claimed(pools)
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


def _claimed(pools: Sequence[KVPool]) -> int:
    return sum(p.required * p.bytes_per_page for p in pools)


def _shrink(pools: list[KVPool], claim: int) -> list[KVPool]:
    """`pools` with the minimums that may shrink (`least_pages`) scaled by one factor so that every pool's
    claim takes `claim` bytes, none below its `least_pages` nor above its minimum."""
    may = [p.pages is None and p.least_pages is not None for p in pools]
    fixed = _claimed([p for p, m in zip(pools, may, strict=True) if not m])
    full = sum(p.min_pages * p.bytes_per_page for p, m in zip(pools, may, strict=True) if m)
    if not full:
        return pools
    scale = max(0.0, min(1.0, (claim - fixed) / full))
    return [
        replace(p, min_pages=max(p.least_pages or 0, int(p.min_pages * scale))) if m else p
        for p, m in zip(pools, may, strict=True)
    ]


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
