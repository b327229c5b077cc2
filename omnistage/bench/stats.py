"""What one benchmark pass measured, reduced to its numbers: real-time factor, TTFT and TPOT statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestTiming:
    """One request, timed from its submission (seconds)."""

    audio_s: float  # input audio
    ttft_s: float  # to the first generated token
    latency_s: float  # to the last
    output_tokens: int
    stages: dict[str, float] = field(default_factory=dict)  # seconds per named stage, where the target tells

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first; NaN for a single token."""
        if self.output_tokens < 2:
            return math.nan
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks, NaNs left out; NaN if empty."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def _mean(values: list[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return sum(data) / len(data) if data else math.nan


def real_time_factor(audio_s: float, wall_s: float) -> float:
    """Seconds of input audio handled per wall-clock second (20 means twenty times faster than real time)."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be positive, got {wall_s}")
    return audio_s / wall_s


def summarize(
    timings: list[RequestTiming], wall_s: float | list[float], concurrency: int
) -> dict[str, float | int]:
    """The numbers of one or more passes, each every clip once at `concurrency`.

    `timings` holds every request of every pass and `wall_s` each pass's wall time (one number for one
    pass). The real-time factor is one pass's audio over the median pass's wall time; TTFT, TPOT, latency
    and stage figures are over all requests.
    """
    walls = [wall_s] if isinstance(wall_s, (int, float)) else list(wall_s)
    if not walls or len(timings) % len(walls):
        raise ValueError(f"{len(timings)} requests do not split into {len(walls)} equal passes")
    per_pass = timings[: len(timings) // len(walls)]
    audio = sum(t.audio_s for t in per_pass)
    ms = 1e3
    summary: dict = {
        "concurrency": concurrency,
        "requests": len(per_pass),
        "passes": len(walls),
        "audio_s": round(audio, 3),
        "wall_s": round(median(walls), 4),
        "rtf": round(real_time_factor(audio, median(walls)), 3),
        "ttft_median_ms": round(median([t.ttft_s for t in timings]) * ms, 2),
        "ttft_p90_ms": round(percentile([t.ttft_s for t in timings], 90) * ms, 2),
        "tpot_median_ms": round(median([t.tpot_s for t in timings]) * ms, 3),
        "latency_median_ms": round(median([t.latency_s for t in timings]) * ms, 2),
        "output_tokens": sum(t.output_tokens for t in per_pass),
    }
    if len(walls) > 1:
        summary["rtf_per_pass"] = [round(real_time_factor(audio, w), 3) for w in walls]
    names = list(dict.fromkeys(name for t in timings for name in t.stages))
    if names:
        by_name = {name: [t.stages.get(name, math.nan) for t in timings] for name in names}
        summary["stages_median_ms"] = {name: round(median(v) * ms, 2) for name, v in by_name.items()}
        # means too: the server's /metrics phases are means, and a burst's stages are far from symmetric
        summary["stages_mean_ms"] = {name: round(_mean(v) * ms, 2) for name, v in by_name.items()}
    return summary


def stage_lines(passes: list[dict[str, Any]], since: str) -> list[str]:
    """A report's line per pass with stages: each stage's median, `since` saying where its clock starts."""
    lines = []
    for p in passes:
        if "stages_median_ms" in p:
            stages = ", ".join(f"{k} {v:.1f}" for k, v in p["stages_median_ms"].items())
            lines.append(f"\nours, c={p['concurrency']}, {since} (median ms): {stages}")
    return lines


def json_safe(value: Any) -> Any:
    """NaN (a one-token TPOT, a missing TTFT) as null, which every JSON reader accepts."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
