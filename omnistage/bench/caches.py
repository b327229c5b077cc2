"""What the engine's caches served while a benchmark ran: the prefix cache's prompt tokens (the Thinker's or
the decoder's, and the Talker's rows) and the audio tower's clips, from an in-process pipeline's stats or a
running server's /metrics, taken before and after. The benchmarks send every request distinct inputs, so that these stay near zero (a shared
chat template's first page aside): a run reports them to show that it measured computing, not cache hits."""

from __future__ import annotations

from collections.abc import Mapping

COUNTS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "talker_prefix_cache_queries",
    "talker_prefix_cache_hits",
    "encoder_cache_hits",
    "encoder_cache_misses",
)


def cache_counts(stats: Mapping[str, int]) -> dict[str, int]:
    """The cache counters among a pipeline's stats (those its family has)."""
    return {name: int(stats[name]) for name in COUNTS if name in stats}


def served_since(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Each counter's growth from `before` to `after` (both `cache_counts`)."""
    return {name: after[name] - before.get(name, 0) for name in after}


def on_server(url: str) -> dict[str, int]:
    """The cache counters a running server reports on /metrics (`omnistage_<counter>_total`), as cache_counts."""
    import httpx

    reported = {}
    for line in httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        counter = name.removeprefix("omnistage_").removesuffix("_total")
        if name.endswith("_total") and counter in COUNTS:
            reported[counter] = int(float(value))
    return reported
