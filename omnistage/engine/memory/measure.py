"""Reading a device and what a piece of GPU work costs it, for the memory plan (GPU only; the plan itself is
memory.plan)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from omnistage.engine.memory.plan import Bucket, DeviceMemory, GiB, GraphCandidates, GraphKind, scaled_costs

log = logging.getLogger(__name__)


def read_device(device: torch.device, limit_gib: float | None) -> DeviceMemory:
    """What `device` offers this process now that the stages placed on it are loaded; caps the caching
    allocator there at `limit_gib` (gpu_memory_limit), which the plan then fills."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks this process freed while loading are free for the plan too
    allocated = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    log.info(
        "after loading: %.2f GiB allocated on %s by this process, %.2f GiB free (%.2f GiB held by other "
        "processes or the driver)",
        allocated / GiB,
        device,
        free / GiB,
        (total - free - torch.cuda.memory_reserved(device)) / GiB,
    )
    limit = int(limit_gib * GiB) if limit_gib else None
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    return DeviceMemory(total=total, free=free, allocated=allocated, limit=limit, name=str(device))


@dataclass
class Peak:
    bytes: int = 0
    kept: int = 0  # of those, what the block still holds at its end (its outputs)


@contextmanager
def device_peak(device: torch.device) -> Iterator[Peak]:
    """The bytes the work inside the block takes from the device at its peak, as the caching allocator
    reserves them: its block rounding and splits included, not only the tensors' own bytes. A floor counted
    in allocated bytes alone left the allocator short under a memory cap, where it then freed its cache and
    retried (synchronising) during serving.

    Measured from an empty cache: blocks the cache already held would hide part of the peak, so the same
    step measured less on a warm cache than under a memory cap (whose retries empty it), and less than a
    graph takes from its pool, whose first capture gets fresh segments too."""
    peak = Peak()
    # garbage in reference cycles (a graph set holds its bound step) freed inside the block would read as a
    # negative share of what it keeps: collected first
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield peak
    torch.cuda.synchronize(device)
    peak.bytes = max(
        torch.cuda.max_memory_allocated(device) - allocated, torch.cuda.max_memory_reserved(device) - reserved
    )
    peak.kept = min(peak.bytes, max(0, torch.cuda.memory_allocated(device) - allocated))


def scaled_peaks(largest: Peak, buckets: list[int]) -> dict[int, Peak]:
    """Each bucket's graph from the largest bucket's measured step, scaled by size (`scaled_costs`): its bytes
    and what it keeps (outputs and static buffers; the rest is scratch its pool shares)."""
    costs, kept = scaled_costs(largest.bytes, buckets), scaled_costs(largest.kept, buckets)
    return {b: Peak(cost, min(cost, kept[b])) for b, cost in costs.items()}


def graph_candidates(
    stage: str,
    kind: GraphKind,
    unit: str,
    peaks: Mapping[int, Peak] | Mapping[tuple[int, ...], Peak] | Mapping[Bucket, Peak],
    pool: str,
) -> GraphCandidates:
    """A stage's graph set for the plan from its measured peaks per bucket."""
    return GraphCandidates(
        stage,
        kind,
        unit,
        {b: p.bytes for b, p in peaks.items()},
        pool=pool,
        kept={b: p.kept for b, p in peaks.items()},
    )


def allocator_stats(device: torch.device) -> dict[str, int]:
    """The caching allocator's reserved bytes and its retries (a retry frees the cache and synchronises)."""
    stats = torch.cuda.memory_stats(device)
    return {
        "gpu_memory_reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "gpu_alloc_retries": stats.get("num_alloc_retries", 0),
    }


class Weighted(Protocol):
    """A module, or what a stage types one as (an encoder tower's protocol): whatever has parameters."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def module_bytes(module: Weighted) -> int:
    """What a module's parameters hold: a stage's weights, as its `StageMemory.resident` lists them."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
