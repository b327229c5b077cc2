"""Where a decode step's time goes on the GPU: the step's wall time against its kernels' time and launches.

    python3 benchmarks/decode_profile.py --skeleton qwen3-asr-1.7b --seconds 120 --out-dir $OUT   # GPU machine

Builds the released sizes with random bf16 weights (`--skeleton`, as `omnistage bench a2t` does), admits
`--batch` transcriptions of one synthetic clip with their lengths forced, steps until every request has its
first token, then over `--steps` pure decode steps measures:
- the wall time of each `engine.step()` (median), nothing added: what a token costs, with the steps in lockstep
  (each step's ids read back before the next launches) and decoding ahead (the default: the next step launches
  first, engine/decode_ahead.py);
- the batch's decode graph replayed back to back on the last step's inputs (it rewrites the same K/V): the
  GPU's time for a step with no host work between steps;
- one run of the same number of steps under torch.profiler, decoding ahead: the kernels' summed time per step, their launches
  per step, and the GPU's busy time (the union of the kernels' intervals) against the span from the first
  kernel to the last, whose difference is the GPU waiting between kernels (launch gaps in a graph, or the
  host); the top kernels by total time; the host's top operators by their own time; and the host's copies and
  pinnings (`SITE_CALLS`) by the omnistage line that made them (its two innermost frames), so that a copy
  that waits or a block that is registered is found where it is asked for.
`--arrivals K` then measures loaded steps as well: before each, K more transcriptions of the clip arrive (each
one token long), so a step encodes their clips and prefills their prompts beside the batch's decode rows, as a
server under load does (Qwen3-ASR at c=128: ~125 decode rows and two or three ~75-token prompts a step); their
wall time decoding ahead and the same profile, under "loaded".
Writes `decode_profile_<skeleton>_b<batch>.{json,md}` under --out-dir. `--model DIR --device cpu` is a smoke run.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omnistage.bench.clips import Clip, synth_clips
from omnistage.bench.skeletons import SKELETONS, released_skeleton
from omnistage.config import engine_config
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.pipeline.family import build_pipeline
from omnistage.request import SamplingParams

# The host calls that may wait for the device or pin memory, whose own time `_sites` sums by the line asking.
SITE_CALLS = (
    "cudaMemcpyAsync",
    "cudaHostRegister",
    "cudaHostAlloc",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
)


SITE_STEPS = 10  # the steps profiled with Python stacks: every Python call an event, a costly profile


def _omnistage_frames(event: Any) -> list[str]:
    return [f for f in (event.stack or [event.name]) if "omnistage/" in f]


class _Enclosing:
    """The events with an omnistage frame, per thread in order of their start: those whose time encloses another
    event's are the calls it ran under."""

    def __init__(self, events: list[Any]) -> None:
        self._by_thread: dict[int, list[Any]] = {}
        for event in events:
            if _omnistage_frames(event):
                self._by_thread.setdefault(event.thread, []).append(event)
        for line in self._by_thread.values():
            line.sort(key=lambda e: e.time_range.start)
        self._starts = {t: [e.time_range.start for e in line] for t, line in self._by_thread.items()}

    def frames(self, event: Any) -> list[str]:
        """The innermost two omnistage frames of the events enclosing `event` on its thread."""
        line = self._by_thread.get(event.thread, [])
        start, end = event.time_range.start, event.time_range.end
        frames: list[str] = []
        for i in range(bisect.bisect_right(self._starts.get(event.thread, []), start) - 1, -1, -1):
            if len(frames) == 2:
                break
            if line[i].time_range.end >= end and line[i] is not event:
                frames += _omnistage_frames(line[i])[: 2 - len(frames)]
        return frames


def _sites(events: list[Any], steps: int) -> list[dict[str, Any]]:
    """The events named in `SITE_CALLS`, by call and by the innermost two omnistage frames above them (torch.profiler's
    `with_stack` records each Python call as an event, a parent of the operators it runs; an operator's own stack
    is read where a build keeps one there): count and own µs per step, the costliest first. A CUDA runtime call
    the profiler links to no parent with such a frame is placed by time: the events of its thread that enclose it
    (`_Enclosing`)."""
    totals: dict[tuple[str, str], list[float]] = {}
    enclosing: _Enclosing | None = None
    for event in events:
        if event.name not in SITE_CALLS:
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None and len(frames) < 2:  # the Python calls above it are events of their own
            frames += _omnistage_frames(parent)[: 2 - len(frames)]
            parent = parent.cpu_parent
        if not frames:
            enclosing = enclosing or _Enclosing(events)
            frames = enclosing.frames(event)
        site = " < ".join(f.split("omnistage/", 1)[1] for f in frames) or "(no omnistage frame)"
        total = totals.setdefault((event.name, site), [0, 0.0])
        total[0] += 1
        total[1] += event.self_cpu_time_total
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    return [
        {"call": call, "site": site, "per_step": round(n / steps, 1), "us_per_step": round(us / steps, 1)}
        for (call, site), (n, us) in ranked[:15]
    ]


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of `(start, end)` intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _kernel_time(event: Any) -> float:
    return event.device_time_total if event.device_time_total > 0 else event.self_cpu_time_total


def graph_replay_ms(engine: Any, batch: int, replays: int) -> float | None:
    """Milliseconds per replay of the decode graph that holds `batch`, replayed back to back (None: no graph)."""
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    if bucket is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graphs.replay(bucket)  # over what the buffers hold: the last step's rows
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / replays, 3)


_NUMBERS = itertools.count()  # every request's own number, for its own clip


def _prompts(engine: Any, clip: Clip, count: int) -> list[Any]:
    """`count` prompts of `clip`, each heard as a request of its own (`Clip.heard_as`): neither the prefix cache
    nor the audio tower's cache serves them, as neither would serve a server's distinct recordings."""
    return [
        engine.processor.transcription(clip.heard_as(next(_NUMBERS)).audio, None, None) for _ in range(count)
    ]


def _requests(prompts: list[Any], tokens: int, tag: str) -> list[NewRequest]:
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
    return [
        NewRequest(f"{tag}-{i}", p.token_ids, params, p.prompt, mrope=p.mrope, mm=p.mm)
        for i, p in enumerate(prompts)
    ]


def _profiled(engine: Any, steps: int, before_step: Callable[[int], None]) -> dict[str, Any]:
    """`steps` engine steps under torch.profiler (`before_step(i)` first, inside it): per step, the kernels'
    summed time, their launches, the GPU's busy time against its span; the top kernels and host operators."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            before_step(i)
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    span = (max(i[1] for i in intervals) - min(i[0] for i in intervals)) if intervals else 0.0
    by_kernel = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total
    )
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {
        "kernel_ms_per_step": round(sum(_kernel_time(e) for e in kernels) / steps / 1e3, 3),
        "gpu_busy_ms_per_step": round(_busy_us(intervals) / steps / 1e3, 3),
        "gpu_span_ms_per_step": round(span / steps / 1e3, 3),
        "launches_per_step": round(len(kernels) / steps, 1),
        "top_kernels": [
            {"name": e.key[:90], "per_step": round(e.count / steps, 1), "us_per_step": round(e.device_time_total / steps, 1)}
            for e in by_kernel[:20]
        ],
        "top_host_ops": [
            {"name": e.key[:90], "per_step": round(e.count / steps, 1), "us_per_step": round(e.self_cpu_time_total / steps, 1)}
            for e in host[:15]
        ],
        "host_call_sites": _call_sites(engine, min(steps, SITE_STEPS), before_step),
    }  # fmt: skip


def _call_sites(engine: Any, steps: int, before_step: Callable[[int], None]) -> list[dict[str, Any]]:
    """`steps` more engine steps under torch.profiler with Python stacks (apart from the timed profile: the
    stacks' own cost), the host calls of `SITE_CALLS` by where they are asked for (`_sites`)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for i in range(steps):
            before_step(i)
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return _sites(list(prof.events()), steps)


def profile_decode(
    engine: Any, clip: Clip, batch: int, steps: int, output_tokens: int, arrivals: int = 0
) -> dict[str, Any]:
    requests = _requests(_prompts(engine, clip, batch), output_tokens, "decode")
    assert not any(engine.add_requests(requests))
    while engine.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    walls = {}
    for ahead in (False, True):
        engine.decode_ahead = ahead
        engine.step()  # the switch's step
        walls[ahead] = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls[ahead].append((time.perf_counter() - start) * 1e3)
    replay_ms = graph_replay_ms(engine, batch, steps) if torch.cuda.is_available() else None
    result = {
        "batch": batch,
        "steps": steps,
        "prompt_tokens": len(requests[0].prompt_token_ids),
        "step_wall_median_ms": round(statistics.median(walls[False]), 3),
        "step_wall_ahead_median_ms": round(statistics.median(walls[True]), 3),
        "graph_replay_ms": replay_ms,
        **_profiled(engine, steps, lambda i: None),
    }
    if arrivals:
        result["loaded"] = profile_loaded(engine, clip, steps, arrivals)
    while engine.has_unfinished():
        engine.step()
    return result


def profile_loaded(engine: Any, clip: Clip, steps: int, arrivals: int) -> dict[str, Any]:
    """Steps of the decoding batch with `arrivals` new requests admitted before each (a server under load): the
    arrivals' clips encoded, their prompts prefilled beside the decode rows; each samples one token and ends,
    so the batch stays the same. Their wall time (decoding ahead) and, in as many more, their profile (then as
    many again for the host calls' sites). The arrivals' prompts are laid out before any of it."""
    batches = iter(range(3 * steps + 1))
    prompts = iter(_prompts(engine, clip, 3 * steps * arrivals))

    def arrive(_: int) -> None:
        arriving = [next(prompts) for _ in range(arrivals)]
        assert not any(engine.add_requests(_requests(arriving, 1, f"arrival{next(batches)}")))

    walls = []
    for i in range(steps):
        arrive(i)
        start = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - start) * 1e3)
    profiled = _profiled(engine, steps, arrive)
    decoding = sum(1 for s in engine.scheduler.running if s.request_id.startswith("decode"))
    return {
        "arrivals": arrivals,
        "decoding_after": decoding,  # the batch's requests still decoding after the loaded steps: all of them
        "step_wall_ahead_median_ms": round(statistics.median(walls), 3),
    } | profiled


def _tables(r: dict[str, Any]) -> list[str]:
    return [
        "| kernel | per step | µs per step |",
        "| --- | --- | --- |",
        *[f"| `{k['name']}` | {k['per_step']} | {k['us_per_step']} |" for k in r["top_kernels"]],
        "",
        "| host operator | per step | own µs per step |",
        "| --- | --- | --- |",
        *[f"| `{k['name']}` | {k['per_step']} | {k['us_per_step']} |" for k in r["top_host_ops"]],
        "",
        "| host call | where (omnistage, innermost first) | per step | own µs per step |",
        "| --- | --- | --- | --- |",
        *[
            f"| `{k['call']}` | {k['site']} | {k['per_step']} | {k['us_per_step']} |"
            for k in r["host_call_sites"]
        ],
        "",
    ]


def _per_step(r: dict[str, Any]) -> str:
    return (
        f"{r['launches_per_step']:,} kernels, {r['kernel_ms_per_step']:.3f} ms of kernel time, the GPU busy "
        f"{r['gpu_busy_ms_per_step']:.3f} ms of a {r['gpu_span_ms_per_step']:.3f} ms span."
    )


def markdown(name: str, r: dict[str, Any]) -> str:
    loaded = r.get("loaded")
    more = []
    if loaded is not None:
        more = [
            f"#### With {loaded['arrivals']} arrivals a step",
            "",
            f"Step wall time decoding ahead (median): {loaded['step_wall_ahead_median_ms']:.3f} ms, "
            f"{loaded['decoding_after']} of the batch still decoding after them. Under the profiler, per step: "
            f"{_per_step(loaded)}",
            "",
            *_tables(loaded),
        ]
    return "\n".join(
        [
            f"### {name}, batch {r['batch']}, {r['prompt_tokens']:,}-token prompt ({r['steps']} decode steps)",
            "",
            f"Step wall time (median): {r['step_wall_median_ms']:.3f} ms in lockstep, "
            f"{r['step_wall_ahead_median_ms']:.3f} ms decoding ahead; the decode graph replayed back to back: "
            f"{r['graph_replay_ms']} ms. Under the profiler (decoding ahead), per step: {_per_step(r)}",
            "",
            *_tables(r),
            *more,
        ]
    )


def tokens_for(steps: int, arrivals: int) -> int:
    """The tokens the decoding batch is forced to, so that it decodes through every measured step: two timed
    runs and two profiled ones, and with arrivals three more runs of loaded steps (with fewer, the batch ran out
    in the first loaded steps, and their profile was of the arrivals alone)."""
    return (4 + (3 if arrivals else 0)) * steps + 8


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skeleton", choices=sorted(SKELETONS), default="qwen3-asr-1.7b")
    parser.add_argument(
        "--model", help="a checkpoint directory instead of the released sizes with dummy weights"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--arrivals", type=int, default=0, help="also loaded steps, with this many arrivals each"
    )
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    where = (
        {"model": args.model}
        if args.model
        else {"model": str(released_skeleton(args.skeleton)), "load_format": "dummy"}
    )
    config = engine_config(
        "decode profile", device=args.device, max_num_seqs=args.batch + args.arrivals, speech=False,
        **({"kv_cache_memory_gib": 16.0} if args.device == "cuda" else {}), **where,
    )  # fmt: skip
    engine = build_pipeline(config).thinker
    clip = synth_clips((args.seconds,), seed=0, espeak=False)[0]
    profile_decode(engine, clip, args.batch, 4, tokens_for(4, args.arrivals), args.arrivals)  # warm-up
    result = profile_decode(
        engine, clip, args.batch, args.steps, tokens_for(args.steps, args.arrivals), args.arrivals
    )
    result["skeleton"] = "model" if args.model else args.skeleton
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_profile_{result['skeleton']}_b{args.batch}" + (
        f"_a{args.arrivals}" if args.arrivals else ""
    )
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result["skeleton"], result)
    (out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
