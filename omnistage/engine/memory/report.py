"""Where a device's memory went once every stage has started: the caching allocator's snapshot grouped by what
holds it (weights, module buffers, KV pools, static buffers and workspaces, CUDA graph pools, per owner), with
what the allocator caches and what nobody accounts for.

`holdings` finds what the stages hold by walking the pipeline's objects: a module's parameters are weights,
tensors under a `kv_caches` attribute are KV pages, a GraphSet's memory pool is its graphs', any other
tensor is a buffer of the object that holds it. `group_snapshot` is the pure part: it matches the snapshot's
blocks against those tensors' addresses and the segments against the graph pools.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine.graphs import GraphSet
from omnistage.engine.memory.plan import GiB, MiB

GROUPS = ("weights", "module buffers", "KV", "buffers", "graph pool")
_KV_ATTRIBUTE = "kv_caches"
_DEFAULT_POOL = (0, 0)  # the allocator's own pool; CUDA graphs capture into private ones


@dataclass
class Holding:
    """What one owner (an attribute path of the pipeline, e.g. `thinker.model`) holds on one device."""

    group: str  # one of GROUPS
    owner: str
    device: int | None  # CUDA index; None off CUDA
    spans: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of its tensors' storages
    pool: tuple[int, int] | None = None  # a graph pool's id
    accounted: int = 0  # bytes by the stage's own accounting: its tensors' bytes, a GraphSet's graph_bytes


def reachable(
    root: object, name: str = "", packages: tuple[str, ...] = ("omnistage",)
) -> Iterator[tuple[str, object]]:
    """(attribute path, object) of everything reachable from `root`, each once: attributes of the objects of
    `packages`, items of lists, tuples and dicts; not inside modules, tensors or other libraries' objects."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(name, root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        yield path, obj
        if isinstance(obj, (torch.nn.Module, torch.Tensor)):
            continue
        if isinstance(obj, dict):
            children = [(f"{path}[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple)):
            children = [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif type(obj).__module__.split(".")[0] in packages and hasattr(obj, "__dict__"):
            children = [(f"{path}.{key}" if path else key, value) for key, value in vars(obj).items()]
        else:
            continue
        stack.extend(reversed(children))  # depth first in attribute order: an owner's first path names it


def holdings(root: object, packages: tuple[str, ...] = ("omnistage",)) -> list[Holding]:
    """What the objects reachable from `root` hold, per (group, owner, device); each storage counted once,
    under the first owner that reaches it."""
    found: dict[tuple[str, str, int | None], Holding] = {}
    counted: set[tuple[int, int]] = set()

    def add(group: str, owner: str, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        span = (storage.data_ptr(), storage.nbytes())
        if span in counted or not span[1]:
            return
        counted.add(span)
        device = tensor.device.index if tensor.device.type == "cuda" else None
        held = found.setdefault((group, owner, device), Holding(group, owner, device))
        held.spans.append(span)
        held.accounted += span[1]

    for path, obj in reachable(root, packages=packages):
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add("weights", path, p)
            for b in obj.buffers():
                add("module buffers", path, b)
        elif isinstance(obj, torch.Tensor):
            # a page of a `kv_caches` list is its owner's KV; a tensor in another container that container's
            # attribute's, one held directly the object's that holds it
            attribute = path.split("[", 1)[0]
            owner = attribute.rpartition(".")[0]
            if attribute.rpartition(".")[2] == _KV_ATTRIBUTE:
                add("KV", owner or attribute, obj)
            else:
                add("buffers", attribute if attribute != path else owner or path, obj)
        elif isinstance(obj, GraphSet) and obj.pool is not None:
            device = obj.device.index if obj.device.type == "cuda" else None
            pool = tuple(obj.pool)
            found[("graph pool", path, device)] = Holding(
                "graph pool", path, device, pool=pool, accounted=sum(obj.graph_bytes.values())
            )
    return list(found.values())


@dataclass(frozen=True)
class ReportRow:
    group: str
    owner: str
    held: int  # bytes the snapshot shows it holding (its blocks; a graph pool's segments)
    accounted: int  # bytes by the stage's own accounting (tensors in a graph pool are the pool's)


@dataclass(frozen=True)
class DeviceReport:
    """One device's allocator snapshot, grouped. Bytes."""

    device: int
    rows: tuple[ReportRow, ...]
    reserved: int  # every segment: what the allocator holds from the device
    allocated: int  # blocks in use
    unaccounted: int  # blocks in use that no holding reaches (temporaries, library workspaces, caches)
    cached: int  # reserved but free, outside the graph pools
    other_pools: int  # private pools no GraphSet names
    total: int | None = None  # the device's memory (torch.cuda.mem_get_info), when known
    free: int | None = None

    def table(self) -> str:
        head = f"memory report of cuda:{self.device}: allocator {_gib(self.reserved)} reserved, "
        head += f"{_gib(self.allocated)} allocated"
        if self.total is not None and self.free is not None:
            outside = self.total - self.free - self.reserved
            head += (
                f"; device {_gib(self.total)}, {_gib(self.free)} free, {_gib(outside)} outside the allocator"
            )
            head += " (CUDA context, libraries, other processes)"
        lines = [head, f"  {'what':<16}{'held by':<40}{'held':>12}{'accounted':>12}"]
        for row in self.rows:
            accounted = _gib(row.accounted) if row.accounted else ""
            group, owner = row.group, row.owner
            if len(owner) >= 40:  # a pool several sets share: its owners on a line of their own
                lines.append(f"  {group:<16}{owner}")
                group = owner = ""
            lines.append(f"  {group:<16}{owner:<40}{_gib(row.held):>12}{accounted:>12}")
        for name, size in (
            ("other graph pools", self.other_pools),
            ("not accounted", self.unaccounted),
            ("allocator cache", self.cached),
        ):
            lines.append(f"  {name:<56}{_gib(size):>12}")
        return "\n".join(lines)


def group_snapshot(
    segments: list[dict[str, Any]],
    held: list[Holding],
    device_memory: dict[int, tuple[int, int]] | None = None,
) -> list[DeviceReport]:
    """Per device in `segments` (`torch.cuda.memory_snapshot()`), its memory by holding: a block in use goes to
    the holding one of whose tensors starts in it, a graph pool's segments whole to its GraphSet (a pool the
    sets of several stages share is one row naming them all). `device_memory`: (free, total) per device, from
    mem_get_info."""
    reports = []
    for device in sorted({s["device"] for s in segments}):
        mine = _one_per_pool([h for h in held if h.device == device])
        on_device = [s for s in segments if s["device"] == device]
        pooled = sorted(
            (s["address"], s["address"] + s["total_size"])
            for s in on_device
            if tuple(s.get("segment_pool_id", _DEFAULT_POOL)) != _DEFAULT_POOL
        )
        starts = sorted(
            (address, i) for i, h in enumerate(mine) for address, _ in h.spans if not _within(address, pooled)
        )
        addresses = [address for address, _ in starts]
        pools: dict[tuple[int, int], int] = {}
        for i, h in enumerate(mine):
            if h.pool is not None:
                pools.setdefault(h.pool, i)
        sizes = [0] * len(mine)
        reserved = allocated = unaccounted = cached = other_pools = 0
        for segment in on_device:
            reserved += segment["total_size"]
            in_use = [b for b in segment["blocks"] if b["state"] != "inactive"]
            allocated += sum(b["size"] for b in in_use)
            pool = tuple(segment.get("segment_pool_id", _DEFAULT_POOL))
            if pool != _DEFAULT_POOL:
                if pool in pools:
                    sizes[pools[pool]] += segment["total_size"]
                else:
                    other_pools += segment["total_size"]
                continue
            cached += segment["total_size"] - sum(b["size"] for b in in_use)
            for block in in_use:
                i = bisect.bisect_left(addresses, block["address"])
                if i < len(addresses) and addresses[i] < block["address"] + block["size"]:
                    sizes[starts[i][1]] += block["size"]
                else:
                    unaccounted += block["size"]
        rows = [
            ReportRow(
                h.group,
                h.owner,
                sizes[i],
                h.accounted if h.pool is not None else sum(n for a, n in h.spans if not _within(a, pooled)),
            )
            for i, h in enumerate(mine)
        ]
        rows = sorted(
            (row for row in rows if row.held or row.accounted),
            key=lambda row: (GROUPS.index(row.group), -row.held, row.owner),
        )
        free, total = (device_memory or {}).get(device, (None, None))
        reports.append(
            DeviceReport(
                device, tuple(rows), reserved, allocated, unaccounted, cached, other_pools, total, free
            )
        )
    return reports


def _one_per_pool(held: list[Holding]) -> list[Holding]:
    """The holdings with the graph sets of one pool merged: their paths joined, their accounting summed."""
    merged: dict[tuple[int, int], Holding] = {}
    out = []
    for h in held:
        if h.pool is None:
            out.append(h)
        elif (first := merged.get(h.pool)) is None:
            merged[h.pool] = Holding(h.group, h.owner, h.device, pool=h.pool, accounted=h.accounted)
            out.append(merged[h.pool])
        else:
            first.owner = f"{first.owner}, {h.owner}"
            first.accounted += h.accounted
    return out


def _within(address: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether `address` lies in one of the sorted, disjoint [start, end) `ranges`."""
    i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
    return i >= 0 and address < ranges[i][1]


def accounting_table(held: list[Holding]) -> str:
    """What the stages hold by their own accounting, per device (for a report without a snapshot)."""
    lines = [f"  {'device':<8}{'what':<16}{'held by':<40}{'bytes':>12}"]
    for h in sorted(
        held, key=lambda h: (h.device is None, h.device or 0, GROUPS.index(h.group), -h.accounted)
    ):
        device = "cpu" if h.device is None else f"cuda:{h.device}"
        lines.append(f"  {device:<8}{h.group:<16}{h.owner:<40}{_gib(h.accounted):>12}")
    return "\n".join(lines)


def _gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB // 10 or size == 0 else f"{size / MiB:.1f} MiB"
