"""The time between one stage's steps in a step trace, and what the engine loop did in it.

    python benchmarks/trace_gaps.py results/trace_asr_fdc38ef_h100o.json [--stage Thinker] [--min-ms 10]

Reads the calls `benchmarks/step_trace.py` wrote (each with its end, `at`, and its time, `ms`) and prints each
gap of more than `--min-ms` between two consecutive steps of `--stage`: its length, the admissions
(`StepLoop._admit`) and the encoder stage's calls (`EncoderStage.encode_many`, inside the admissions) that
overlap it, and the rest, which is none of those: the host's path between a request's end and its next one's
admission (outputs delivered, the next prompts prepared and handed over), or an idle loop waiting for them.
A summary sums each column over the gaps after the first step.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

Call = dict[str, Any]


def span(call: Call) -> tuple[float, float]:
    """(start, end) of a call in seconds."""
    return call["at"] - call["ms"] / 1e3, call["at"]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def gaps(calls: list[Call], stage: str, min_ms: float) -> list[dict[str, Any]]:
    """Each gap over `min_ms` between two of `stage`'s steps, with the admissions' and encoders' time in it."""
    steps = sorted((c for c in calls if c["stage"] == stage), key=lambda c: c["at"])
    admissions = [span(c) for c in calls if c["stage"] == "engine loop"]
    encoders = [span(c) for c in calls if c["stage"] == "encoders"]
    found = []
    for before, after in zip(steps, steps[1:]):
        gap = (before["at"], span(after)[0])
        length = (gap[1] - gap[0]) * 1e3
        if length <= min_ms:
            continue
        admitted = sum(overlap(gap, a) for a in admissions) * 1e3
        encoded = sum(overlap(gap, e) for e in encoders) * 1e3
        found.append(
            {
                "after_ms": round((gap[0] - steps[0]["at"]) * 1e3, 1),
                "gap_ms": round(length, 1),
                "admitting_ms": round(admitted, 1),
                "encoding_ms": round(encoded, 1),
                "rest_ms": round(length - admitted, 1),
                "rows_before": before["rows"],
                "kind_before": before["kind"],
                "kind_after": after["kind"],
            }
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="JSON written by benchmarks/step_trace.py")
    parser.add_argument("--stage", default="Thinker")
    parser.add_argument("--min-ms", type=float, default=10.0)
    args = parser.parse_args()
    with open(args.trace) as f:
        calls = json.load(f)["calls"]
    found = gaps([c for c in calls if "at" in c], args.stage, args.min_ms)
    print(
        "| after the first step, ms | gap ms | admitting ms | of it encoding ms | rest ms | step before | step after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for g in found:
        print(
            f"| {g['after_ms']:,.1f} | {g['gap_ms']:.1f} | {g['admitting_ms']:.1f} | {g['encoding_ms']:.1f} | "
            f"{g['rest_ms']:.1f} | {g['kind_before']} ({g['rows_before']} rows) | {g['kind_after']} |"
        )
    if found:
        total = {
            k: round(sum(g[k] for g in found), 1)
            for k in ("gap_ms", "admitting_ms", "encoding_ms", "rest_ms")
        }
        print(f"\n{len(found)} gaps: {total}")


if __name__ == "__main__":
    main()
