"""A device's memory plan as Prometheus gauge samples, which `/metrics` renders (server/metrics.py)."""

from __future__ import annotations

from typing import NamedTuple

from omnistage.engine.memory.plan import MemoryPlan


class Gauge(NamedTuple):
    """One Prometheus gauge sample of a plan (see GAUGE_HELP)."""

    name: str
    labels: dict[str, str]
    value: float


GAUGE_HELP = {
    "omnistage_memory_plan_bytes": "A device's memory plan: bytes per part (total, weights, kv, graphs, "
    "floor, reserve, free) and stage ('' for a part of the whole device)",
    "omnistage_memory_plan_kv_pages": "KV pages the memory plan gives a stage",
    "omnistage_memory_plan_graphs": "CUDA graph buckets of a stage's set, captured or run eagerly",
    "omnistage_memory_plan_graph_bytes": "Bytes the memory plan gives a stage's captured CUDA graphs",
    "omnistage_memory_plan_floor_phase_bytes": "Measured eager peak of a step the memory floor holds",
}


def plan_gauges(plan: MemoryPlan) -> list[Gauge]:
    """The plan as gauge samples (GAUGE_HELP names them), every one labelled with the device."""
    device = plan.device.name
    graph_bytes: dict[str, int] = {}
    for g in plan.graphs:
        graph_bytes[g.candidates.stage] = graph_bytes.get(g.candidates.stage, 0) + g.bytes
    bytes_rows = [
        ("total", "", plan.total),
        *[("weights", name, size) for name, size, _ in plan.resident],
        *[("kv", kv.pool.stage, kv.bytes) for kv in plan.kv],
        *[("graphs", stage, size) for stage, size in graph_bytes.items()],
        ("floor", "", plan.floor),
        ("reserve", "", plan.reserve),
        ("free", "", plan.free),
    ]
    if not plan.resident:
        bytes_rows.insert(1, ("weights", "", plan.weights))
    out = [
        Gauge("omnistage_memory_plan_bytes", {"device": device, "part": part, "stage": stage}, size)
        for part, stage, size in bytes_rows
    ]
    out += [
        Gauge("omnistage_memory_plan_kv_pages", {"device": device, "stage": kv.pool.stage}, kv.pages)
        for kv in plan.kv
    ]
    for g in plan.graphs:
        labels = {"device": device, "stage": g.candidates.stage, "kind": g.candidates.kind}
        out += [
            Gauge("omnistage_memory_plan_graphs", {**labels, "state": "captured"}, len(g.captured)),
            Gauge("omnistage_memory_plan_graphs", {**labels, "state": "eager"}, len(g.eager)),
            Gauge("omnistage_memory_plan_graph_bytes", labels, g.bytes),
        ]
    out += [
        Gauge("omnistage_memory_plan_floor_phase_bytes", {"device": device, "phase": name}, size)
        for name, size, _ in plan.phases
    ]
    return out
