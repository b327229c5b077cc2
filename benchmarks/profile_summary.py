"""What a `benchmarks/realtime_profile.sh` or `benchmarks/spy.sh` run's outputs say, as text:

    python benchmarks/profile_summary.py DIR [--top 15] > summary.txt

From DIR/gpu.csv (nvidia-smi every 200 ms): the GPU's mean utilisation and the share of samples at 0%.
From DIR/spy.txt (py-spy's collapsed stacks, one sample every 1/rate s): the samples per thread, the busiest
threads' lines where they were found (the innermost frame: a blocking copy shows as the line that made it),
and the engine thread's frames counted inclusively (where its time went, callees included). From DIR/trace.json (step_trace.py), where there is one: the steps' bursts (runs of steps with no gap of 3 s), and the last
turn's burst step by step (when each step ended, the host gap before it, its shape and its host time).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path


def gpu(path: Path) -> str:
    busy = [float(line.rsplit(",", 1)[1].strip().rstrip(" %")) for line in path.read_text().splitlines()]
    idle = sum(b == 0 for b in busy) / len(busy)
    return f"GPU: {len(busy)} samples, mean utilisation {statistics.mean(busy):.1f}%, {idle:.0%} at 0%"


def stacks(path: Path, top: int) -> list[str]:
    threads: Counter[str] = Counter()
    inner: dict[str, Counter[str]] = {}
    engine_inclusive: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        threads[frames[0]] += int(count)
        inner.setdefault(frames[0], Counter())[frames[-1]] += int(count)
        if "omnistage-engine" in frames[0]:
            for frame in set(frames[1:]):
                engine_inclusive[frame] += int(count)
    out = ["Samples per thread:"] + [f"  {n:6d}  {t}" for t, n in threads.most_common(top)]
    for thread, _ in threads.most_common(4):
        out += [f"Innermost frames of {thread}:"]
        out += [f"  {n:6d}  {frame}" for frame, n in inner[thread].most_common(top)]
    if engine_inclusive:
        out += ["The engine thread's frames, each counted in every sample whose stack holds it:"]
        out += [f"  {n:6d}  {frame}" for frame, n in engine_inclusive.most_common(2 * top)]
    return out


def bursts(path: Path) -> list[str]:
    calls = sorted((c for c in json.loads(path.read_text())["calls"] if "at" in c), key=lambda c: c["at"])
    runs: list[list[dict]] = [[calls[0]]]
    for before, call in zip(calls, calls[1:]):
        if call["at"] - before["at"] > 3.0:
            runs.append([])
        runs[-1].append(call)
    start = calls[0]["at"]
    out = ["Bursts of steps (start s, span s, steps):"]
    out += [f"  {r[0]['at'] - start:7.1f}  {r[-1]['at'] - r[0]['at']:5.2f}  {len(r)}" for r in runs]
    # the last turn of the manual part: the burst before the VAD part's and the baseline's (the last one)
    last = runs[-2] if len(runs) > 1 else runs[-1]
    out.append("Its last turn (ms from the burst's start; gap: the host's time since the previous step):")
    previous = last[0]["at"] - last[0]["ms"] / 1e3
    for c in last:
        gap = (c["at"] - c["ms"] / 1e3 - previous) * 1e3
        out.append(
            f"  {(c['at'] - last[0]['at']) * 1e3:8.1f}  gap {gap:6.1f}  {c['stage']:14s} {c['kind']:22s} "
            f"rows {c['rows']:5d}  chunks {c['chunks']:3d}  {c['ms']:7.2f}"
        )
        previous = c["at"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    lines = [gpu(args.dir / "gpu.csv")]
    if (args.dir / "spy.txt").exists():
        lines += stacks(args.dir / "spy.txt", args.top)
    if (args.dir / "trace.json").exists():
        lines += bursts(args.dir / "trace.json")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
