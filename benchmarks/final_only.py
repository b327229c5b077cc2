"""What a response not streamed saves by being handed its finished output alone (`GenerationRequest.final_only`):
requests through the in-process server's AsyncPipeline over host_overhead.py's stand-in decoder (no model work:
the engine's host work, the hand-off to the event loop and the handler's loop over the outputs are what is
left), each consumed as the server's non-streamed handler consumes it (every output taken, the last kept).

    python benchmarks/final_only.py --batches 64,128 --tokens 100 --runs 5

For each batch, `--runs` rounds of `batch` requests at once, all outputs then final only, interleaved: the wall
time from the first request handed over to the last one's final output, and the engine's steps a second over it.
Prints the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import MODES, build, install_no_op, requests  # noqa: E402

from omnistage.pipeline.async_pipeline import AsyncPipeline  # noqa: E402


def served_wall(
    engine: AsyncPipeline, batch: int, args: argparse.Namespace, tag: str, final_only: bool
) -> float:
    """Seconds for `batch` requests of `args.tokens` tokens to end, each consumed as a whole response."""
    params = replace(MODES["greedy"], max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True)
    batch_requests = [
        replace(r, params=params, final_only=final_only) for r in requests(batch, params, args, tag)
    ]

    async def whole(request) -> None:
        last = None
        async for output in engine.generate(request):
            last = output
        assert last is not None and len(last.outputs[0].token_ids) == args.tokens

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(whole(r) for r in batch_requests))
        return time.perf_counter() - started

    return asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="64,128")
    p.add_argument("--tokens", type=int, default=100, help="tokens each request generates")
    p.add_argument("--prompt-len", type=int, default=75)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    # what host_overhead.build sizes the engine by
    args.family, args.loaded, args.warmup, args.steps, args.batches = "asr", "", 0, args.tokens, batches
    with tempfile.TemporaryDirectory() as workdir:
        llm = build(args, Path(workdir))
        install_no_op(llm.engine, 4096 if llm.engine.device.type == "cpu" else llm.engine.vocab_size)
        served = AsyncPipeline(llm.pipeline)
        print(f"{'batch':>5} {'outputs':>11} {'wall ms':>9} {'steps/s':>8}  (medians of {args.runs} runs)")
        for batch in batches:
            walls: dict[bool, list[float]] = {False: [], True: []}
            served_wall(served, batch, args, f"w{batch}", False)  # warm-up
            for run in range(args.runs):
                for final_only in (False, True):
                    walls[final_only].append(
                        served_wall(served, batch, args, f"{batch}-{run}-{final_only}", final_only)
                    )
            for final_only, times in walls.items():
                wall = statistics.median(times)
                print(f"{batch:>5} {'final only' if final_only else 'all':>11} {wall * 1e3:9.1f} "
                      f"{args.tokens / wall:8.1f}")  # fmt: skip
        served.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)  # as host_overhead.py: the host work is one thread
    main()
