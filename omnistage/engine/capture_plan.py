"""Memory-aware capture planning: decode batch buckets, prefill token buckets, and the split of GPU memory
between KV pages and CUDA graphs. Plain arithmetic over measured numbers (bytes), so it is unit-tested without a GPU.

The order of claims on memory: weights, then the measured eager floor (the peak of the largest step: a
text prefill step, or an encoder on the largest input it admits, or a prefill beside the encoder rows one
request holds), a small reserve, at least `min_kv_pages` KV pages, then CUDA graphs cheapest-first within a graph budget
(each bucket all or nothing; decode graphs before prefill graphs, since every token pays for a decode
step), and every byte left goes to more KV pages. What is not captured runs eagerly.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from omnistage.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

# Covers allocator fragmentation, cuBLAS/NCCL workspaces and Triton's launch scratch that the floor
# measurement does not see. A guess until benchmarks/RESULTS.md measures it.
DEFAULT_RESERVE = 512 * MiB
# Share of the memory left after the floor that graphs may take before KV pages get the rest.
DEFAULT_GRAPH_FRACTION = 0.10


def decode_buckets(max_batch: int = 128) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then 2^n and 1.5·2^n (16, 24, 32, 48, 64, 96, 128, 192, ...).

    The steps grow with the batch so that padding wastes at most a third of a step; `max_batch` itself
    is always the last bucket so that every batch up to it has a graph.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    p = 16
    while p <= max_batch:
        buckets.append(p)
        if p * 3 // 2 <= max_batch:
            buckets.append(p * 3 // 2)
        p *= 2
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


def prefill_buckets(max_tokens: int = 512) -> list[int]:
    """Token counts of one-sequence prefill chunks to capture: 16, 24, 32, 48, 64, 96, ... up to `max_tokens`.

    Smaller chunks take the 16-token graph; `max_tokens` itself is the last bucket.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    return [b for b in decode_buckets(max_tokens) if b >= min(16, max_tokens)]


def bucket_for(batch: int, buckets: Iterable[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None (run eagerly) when none does."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    fitting = [b for b in buckets if b >= batch]
    return min(fitting) if fitting else None


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f} GiB"


@dataclass(frozen=True)
class Floor:
    """Measured eager peaks beyond the weights of the phases of the largest requests, in bytes.

    The towers take one largest input per call (`*_encoder`: the peak of one call on the longest clip or the
    largest image the processor admits, its rows included). A request brings up to `audio_clips` such clips
    and `images` such images (what its context holds), encoded one call after another, and holds every
    one's rows (`*_outputs` each) while its prompt prefills in steps no larger than the largest text
    prefill step (`prefill`). The floor is the largest phase.
    """

    prefill: int
    prefill_tokens: int = 0
    audio_encoder: int = 0
    audio_outputs: int = 0
    audio_clips: int = 1
    audio_seconds: float = 0.0
    vision_encoder: int = 0
    image_outputs: int = 0
    images: int = 1
    image_size: tuple[int, int] = (0, 0)  # width x height in pixels
    other_stages: tuple[tuple[str, int, str], ...] = ()  # the largest steps of other stages on the device

    def phases(self) -> list[tuple[str, int, str]]:
        """(name, bytes, what it runs on) of every phase measured."""
        rows = [("text prefill", self.prefill, f"{self.prefill_tokens:,} tokens"), *self.other_stages]
        for kind, tower, peak, each, count, what in (
            ("audio", "audio encoder", self.audio_encoder, self.audio_outputs, self.audio_clips,
             f"{self.audio_seconds:g} s clip"),
            ("image", "vision encoder", self.vision_encoder, self.image_outputs, self.images,
             f"{self.image_size[0]}x{self.image_size[1]} image"),
        ):  # fmt: skip
            if not peak:
                continue
            held = f"{count * each / MiB:,.0f} MiB of encoder rows held"
            rows += [
                (tower, peak + (count - 1) * each, what if count == 1 else f"{count} x {what}, one call each"),
                (f"{kind} prefill", self.prefill + count * each, f"with the {what}'s {held}" if count == 1
                 else f"with {count} x {what}: {held}"),
            ]  # fmt: skip
        return rows

    @property
    def peak(self) -> int:
        return max(size for _, size, _ in self.phases())

    @property
    def largest(self) -> str:
        """The name of the phase that sets the floor."""
        return max(self.phases(), key=lambda row: row[1])[0]


@dataclass(frozen=True)
class StageMemory:
    """What the other stages on a device hold for good (`resident`: their weights and KV pools) and their largest
    steps (`peaks`), each (name, bytes, what), for one plan of the device."""

    resident: tuple[tuple[str, int, str], ...] = ()
    peaks: tuple[tuple[str, int, str], ...] = ()


NO_OTHER_STAGES = StageMemory()


@dataclass(frozen=True)
class MemoryPlan:
    """How one device's memory is split. Every size in bytes."""

    total: int  # what the device (or gpu_memory_limit) offers this process
    weights: int
    floor: int  # measured eager peak of the largest step, beyond the weights
    reserve: int
    kv_bytes_per_page: int
    kv_pages: int
    captured_buckets: tuple[int, ...]  # ascending
    skipped_buckets: tuple[int, ...]  # ascending; these run eagerly
    graph_bytes: int
    free: int  # left over: less than one KV page beyond the reserve
    limit: int | None = None
    graph_costs: dict[int, int] = field(default_factory=dict)
    prefill_captured: tuple[int, ...] = ()  # token buckets, ascending
    prefill_skipped: tuple[int, ...] = ()
    prefill_graph_costs: dict[int, int] = field(default_factory=dict)
    floor_phases: Floor | None = None  # what the floor is the largest of, when more than a text prefill
    resident: tuple[
        tuple[str, int, str], ...
    ] = ()  # what other stages hold within `weights` (their weights, KV)

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.kv_bytes_per_page

    def bucket_for(self, batch: int) -> int | None:
        """The captured bucket to replay for `batch` rows, or None to run eagerly."""
        return bucket_for(batch, self.captured_buckets)

    def table(self) -> str:
        n_graphs = len(self.captured_buckets)
        n_all = n_graphs + len(self.skipped_buckets)
        graphs = f"{n_graphs}/{n_all} buckets"
        if self.captured_buckets:
            graphs += f" (batch {self.captured_buckets[0]}..{self.captured_buckets[-1]})"
        if self.prefill_graph_costs:
            graphs += f", prefill {len(self.prefill_captured)}/{len(self.prefill_graph_costs)}"
            if self.prefill_captured:
                graphs += f" (tokens {self.prefill_captured[0]}..{self.prefill_captured[-1]})"
        phases = self.floor_phases.phases() if self.floor_phases else []
        rows = [
            ("weights", self.weights, "of which:" if self.resident else ""),
            *[(f"  {name}", size, note) for name, size, note in self.resident],
            ("KV pages", self.kv_bytes, f"{self.kv_pages:,} pages × {self.kv_bytes_per_page / MiB:.2f} MiB"),
            ("CUDA graphs", self.graph_bytes, graphs),
            ("floor (eager peak)", self.floor, "the largest of:" if self.floor_phases else ""),
            *[(f"  {name}", size, note) for name, size, note in phases],
            ("reserve", self.reserve, ""),
            ("free", self.free, ""),
        ]
        budget = "gpu_memory_limit" if self.limit is not None else "device"
        lines = [f"memory plan ({budget}: {self.total / GiB:.2f} GiB)"]
        lines += [f"  {name:<19}{_gib(size)}  {note}".rstrip() for name, size, note in rows]
        if self.skipped_buckets:
            lines.append(f"  eager batches: {', '.join(map(str, self.skipped_buckets))}")
        if self.prefill_skipped:
            lines.append(f"  eager prefill chunks of: {', '.join(map(str, self.prefill_skipped))} tokens")
        return "\n".join(lines)


def plan_memory(
    total: int,
    free_after_weights: int,
    weights: int,
    floor_peak: int | Floor,
    kv_bytes_per_page: int,
    graph_cost_per_bucket: dict[int, int],
    limit: int | None = None,
    reserve: int = DEFAULT_RESERVE,
    graph_budget: int | None = None,
    min_kv_pages: int = 1,
    prefill_graph_costs: dict[int, int] | None = None,
) -> MemoryPlan:
    """Split the memory left after the weights between the floor, KV pages and CUDA graphs.

    total: the device's memory; free_after_weights: `torch.cuda.mem_get_info()[0]` once the weights are
    loaded (other processes and the CUDA context are already out of it); weights: bytes of the loaded
    weights; floor_peak: the measured eager peak of the largest step beyond the weights, or the peaks of
    every phase of the largest requests (their largest is the floor);
    graph_cost_per_bucket: decode bucket → bytes its graph adds to the graph pool; prefill_graph_costs: the
    same per prefill token bucket, claimed after the decode graphs; limit: the
    `gpu_memory_limit` in bytes, a cap on everything this process holds, weights included;
    graph_budget: bytes graphs may take (default: DEFAULT_GRAPH_FRACTION of what the floor leaves).
    """
    if kv_bytes_per_page < 1:
        raise ValueError(f"kv_bytes_per_page must be positive, got {kv_bytes_per_page}")
    phases = floor_peak if isinstance(floor_peak, Floor) and len(floor_peak.phases()) > 1 else None
    floor_peak = floor_peak.peak if isinstance(floor_peak, Floor) else floor_peak
    available = free_after_weights
    if limit is not None:
        available = min(available, limit - weights)
    needed = floor_peak + reserve + min_kv_pages * kv_bytes_per_page
    if available < needed:
        cap = f"gpu_memory_limit {limit / GiB:.2f} GiB" if limit is not None else f"{total / GiB:.2f} GiB"
        raise ConfigError(
            f"the model does not fit in {cap}: weights {weights / GiB:.2f} GiB + floor "
            f"{floor_peak / GiB:.2f} GiB{f' (the {phases.largest})' if phases else ''} + reserve {reserve / GiB:.2f} GiB + {min_kv_pages} KV page(s) "
            f"{min_kv_pages * kv_bytes_per_page / GiB:.2f} GiB = {(weights + needed) / GiB:.2f} GiB, but only "
            f"{(weights + max(available, 0)) / GiB:.2f} GiB is available ({free_after_weights / GiB:.2f} GiB "
            f"free after the weights)"
        )
    spare = available - needed  # beyond the floor, the reserve and the minimum KV pages
    if graph_budget is None:
        graph_budget = int(DEFAULT_GRAPH_FRACTION * spare)
    graph_budget = max(0, min(graph_budget, spare))

    captured, graph_bytes = _claim(graph_cost_per_bucket, graph_budget)
    prefill_costs = prefill_graph_costs or {}
    prefill, prefill_bytes = _claim(prefill_costs, graph_budget - graph_bytes)
    graph_bytes += prefill_bytes

    kv_pages = min_kv_pages + (spare - graph_bytes) // kv_bytes_per_page
    free = available - floor_peak - reserve - graph_bytes - kv_pages * kv_bytes_per_page
    return MemoryPlan(
        total=total if limit is None else min(total, limit),
        weights=weights,
        floor=floor_peak,
        reserve=reserve,
        kv_bytes_per_page=kv_bytes_per_page,
        kv_pages=kv_pages,
        captured_buckets=tuple(captured),
        skipped_buckets=tuple(sorted(set(graph_cost_per_bucket) - set(captured))),
        graph_bytes=graph_bytes,
        free=free,
        limit=limit,
        graph_costs=dict(graph_cost_per_bucket),
        prefill_captured=tuple(prefill),
        prefill_skipped=tuple(sorted(set(prefill_costs) - set(prefill))),
        prefill_graph_costs=dict(prefill_costs),
        floor_phases=phases,
    )


def _claim(costs: dict[int, int], budget: int) -> tuple[list[int], int]:
    """Buckets cheapest first while they fit `budget` whole (ascending), and the bytes they take."""
    taken, used = [], 0
    for bucket, cost in sorted(costs.items(), key=lambda kv: (kv[1], kv[0])):
        if used + cost > budget:
            break  # sorted by cost: nothing after this fits either
        taken.append(bucket)
        used += cost
    return sorted(taken), used


def kv_bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype_bytes: int = 2
) -> int:
    """Bytes of one page across every layer: K and V, `page_size` tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * page_size * dtype_bytes
