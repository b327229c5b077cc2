"""Time to the first token under the engine's scheduler, with steps timed by a linear cost model, not a GPU.

Runs `omnistage.engine.scheduler.Scheduler` (pure bookkeeping) over bursts of prompts and prices each step as
`fixed + per_token x prompt rows + per_decode x decode rows` milliseconds. The Thinker's prices come from an
H100's 30 s video: 22,013 prompt tokens prefilled in 1,254 ms after the towers (benchmarks/RESULTS.md, "A 30 s
video with its sound, the path on and off"), ~0.057 ms a token; Qwen3-ASR 0.6B's from its steps on an H100
(3 ms a decode step of 128 rows, ~9 ms with 1,820 prompt rows beside them: "Where the 0.6B's steps go now").
The figures compare scheduling policies, one tree against another, on the same model; they are not serving
figures.

    python benchmarks/scheduler_sim.py                              # this tree
    PYTHONPATH=<other tree> python benchmarks/scheduler_sim.py      # another, from outside this one
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.scheduler import Scheduler
from omnistage.engine.sequence import Sequence


@dataclass(frozen=True)
class Prices:
    fixed_ms: float
    per_token_ms: float
    per_decode_ms: float


THINKER = Prices(5.0, 0.057, 0.02)
ASR = Prices(3.0, 0.0033, 0.0)


def first_tokens(
    prompts: list[int],
    budget: int,
    prices: Prices,
    arrivals: list[float] | None = None,
    max_tokens: int = 40,
    max_seqs: int = 128,
) -> list[float]:
    """Each request's time from its arrival to its first token (ms), the requests arriving at `arrivals`
    (default: all at 0) and each decoding `max_tokens` tokens."""
    scheduler: Scheduler[None] = Scheduler(PagePool(1 << 20, 16), max_seqs, budget)
    arrivals = arrivals or [0.0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    now, first = 0.0, {}
    while pending or scheduler.has_unfinished():
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            scheduler.add(Sequence(str(i), [1] * prompts[i], max_tokens, data=None))
        if not scheduler.has_unfinished():
            now = arrivals[pending[0]]
            continue
        out = scheduler.schedule()
        decodes = sum(1 for c in out.chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens)
        now += (
            prices.fixed_ms
            + prices.per_token_ms * (out.num_tokens - decodes)
            + prices.per_decode_ms * decodes
        )
        sampled = {c.seq.request_id: 7 for c in out.chunks if c.samples}
        for request_id in sampled:
            first.setdefault(int(request_id), now)
        scheduler.update(out, sampled)
    return [first[i] - arrivals[i] for i in range(len(prompts))]


# name, prompt lengths, per-step budget, prices, arrival times (ms)
WORKLOADS = [
    ("8 x 10 s video at once, 2,048 a step", [7353] * 8, 2048, THINKER, None),
    ("8 x 10 s video at once, 8,192 a step", [7353] * 8, 8192, THINKER, None),
    ("8 x 30 s video at once, 2,048 a step", [22013] * 8, 2048, THINKER, None),
    ("30 s video, a chat at 200 ms", [22013, 30], 2048, THINKER, [0.0, 200.0]),
    ("2 x 10 s video, a chat at 100 ms", [7353, 7353, 30], 2048, THINKER, [0.0, 0.0, 100.0]),
    ("64 x 2-min clips at once (Qwen3-ASR)", [1575] * 64, 2048, ASR, None),
    ("128 x 5 s clips at once (Qwen3-ASR)", [75] * 128, 2048, ASR, None),
]


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    print("| workload | first request ms | median ms | mean ms | last ms | the chat ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, prompts, budget, prices, arrivals in WORKLOADS:
        ttft = first_tokens(prompts, budget, prices, arrivals)
        chat = f"{ttft[-1]:,.0f}" if arrivals else ""
        print(
            f"| {name} | {ttft[0]:,.0f} | {statistics.median(ttft):,.0f} | {statistics.mean(ttft):,.0f} | "
            f"{max(ttft):,.0f} | {chat} |"
        )


if __name__ == "__main__":
    main()
