"""The buckets of a graph set: which batch sizes (or prompt-chunk lengths) are captured, and which captured graph a
step of a given size replays. Plain arithmetic; `memory.plan` decides how many of them memory allows."""

from collections.abc import Iterable


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
    """Token counts of prefill steps to capture: 16, 24, 32, 48, 64, 96, ... up to `max_tokens`.

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


def faster_buckets(replay_ms: dict[int, float], margin: float = 0.05) -> dict[int, int]:
    """Bucket -> the captured bucket its batches replay: itself, or the larger bucket whose graph replays
    fastest when that beats it by more than `margin` (measured noise is not a reason to pad).

    A larger bucket can be faster: cuBLAS picks a GEMM kernel per row count, and on an H200 a projection of
    8 rows is up to 2.4x faster than of 1 row (the code predictor's 2048-to-1024 `o_proj`: 5.3 against 12.6 µs,
    `benchmarks/small_gemm.py`). Where padding rows cost real work (a MoE layer reads an expert's weights per
    row) the larger bucket is slower and nothing moves.
    """
    routes = {}
    for bucket in sorted(replay_ms):
        best = bucket
        for larger in sorted(b for b in replay_ms if b > bucket):
            if replay_ms[larger] < replay_ms[best] * (1 - margin):
                best = larger
        routes[bucket] = best
    return routes
