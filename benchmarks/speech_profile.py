"""Where one speaking step's time goes: the pipeline's phases at c speaking requests, and the top CUDA kernels.

    python benchmarks/speech_profile.py --concurrency 1,16 --out-dir $OUT     # on the GPU machine

Builds the released sizes with random bf16 weights (as `omnistage bench t2s` does), starts c text-to-speech
requests with their lengths forced (100 text tokens, 125 frames), and once every Talker decodes, times
`--steps` pipeline steps two ways:
- plain: the wall time of each `pipeline.step()` (median), nothing added; also with `pipeline.steps.overlap` on
  (the Thinker's step beside the speech stages' instead of before them, pipeline/side_stream.py; off by
  default, README);
- by phase: each phase of the step (Thinker step, Talker step, code predictor on the Talker's device-side
  ids, the ids' read-back, the code predictor after it (a failure's retry), Talker input rows, Code2Wav, the
  rest) wrapped in a CUDA synchronisation and a host clock. The syncs cost a little and stop
  the GPU from running ahead, so the phases add up to slightly more than the plain step.
Then one step under torch.profiler: the CUDA kernels with the most total time, the count of launches, how
long the GPU sat idle between the step's first and last kernel and the longest such gaps (each with the
kernels either side: where the host kept the GPU waiting); its trace is saved as a Chrome trace. And each
stage's graph alone, replayed back to back (the Talker's and the code predictor's at batch c): what the step
would take if the host never made the GPU wait.
`--text-tokens 4` measures the steps after the Thinker has ended (most of a text-to-speech request's).
Writes `speech_profile.json`, `speech_profile.md` and `speech_trace_c<c>.json` under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from omnistage.bench.skeletons import released_skeleton
from omnistage.config import engine_config
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.pipeline.family import build_pipeline
from omnistage.request import SamplingParams, SpeechParams, talker_sampling_defaults

# by default the Thinker still decodes through every measured step (three sets of --steps): it does for the first
# 40 frames of the benchmarks' requests
TEXT_TOKENS, FRAMES = 100, 125
GAPS_LISTED = 12


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(pipeline: Any, count: int, tag: str, text_tokens: int) -> list[NewRequest]:
    text = SamplingParams(max_tokens=text_tokens, min_tokens=text_tokens, temperature=0.0, ignore_eos=True)
    talker = replace(talker_sampling_defaults(), max_tokens=FRAMES, min_tokens=FRAMES, ignore_eos=True)
    speech = SpeechParams(voice="ethan", talker=talker)
    prompt, ids = pipeline.processor.encode_chat(
        [{"role": "user", "content": "Tell me about the history of the bicycle."}], True, 4096
    )
    return [NewRequest(f"{tag}-{i}", ids, text, prompt, speech=speech) for i in range(count)]


def _timed(phases: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            phases.setdefault(name, []).append(time.perf_counter() - start)

    return wrapper


def _time(event: Any) -> float:
    """Microseconds of an op on the GPU (or, on a CPU-only smoke run, of its own CPU time)."""
    return event.device_time_total if torch.cuda.is_available() else event.self_cpu_time_total


def _until_all_speak(pipeline: Any, count: int, thinker_done: bool) -> None:
    while sum(1 for s in pipeline._speaking.values() if s.codes) < count or (
        thinker_done and pipeline.thinker.has_unfinished()
    ):
        pipeline.step()


def idle(prof: Any) -> dict[str, Any]:
    """The GPU's idle time between the profiled step's first and last kernel, and its longest gaps."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return {}
    gaps, reach, before = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > reach:
            gaps.append((start - reach, before, name))
        if end > reach:
            reach, before = end, name
    span = reach - kernels[0][0]
    idle_us = sum(g for g, _, _ in gaps)
    return {
        "span_ms": round(span / 1e3, 3),
        "idle_ms": round(idle_us / 1e3, 3),
        "gaps_over_5us": sum(1 for g, _, _ in gaps if g > 5),
        "longest_gaps": [
            {"us": round(g, 1), "after": a[:70], "before": b[:70]}
            for g, a, b in sorted(gaps, reverse=True)[:GAPS_LISTED]
        ],
    }


def graphs_alone(pipeline: Any, concurrency: int) -> dict[str, float]:
    """Milliseconds of one replay of the Talker's and the code predictor's graph at `concurrency` rows, back to
    back over padding rows (GPU only)."""
    stages = pipeline.speech_stages
    out = {}
    for name, graphs in (
        ("Talker", stages.talker_stage.runner.graphs),
        ("code predictor", stages.frame_graphs),
    ):
        bucket = graphs.bucket_for(concurrency) if graphs is not None else None
        if bucket is not None and torch.cuda.is_available():
            with stages.on_device():
                out[f"{name} (bucket {bucket})"] = round(graphs.time_replays([bucket])[bucket], 3)
    return out


def profile(pipeline: Any, concurrency: int, steps: int, text_tokens: int, out_dir: Path) -> dict[str, Any]:
    errors = pipeline.add_requests(_requests(pipeline, concurrency, f"plain{concurrency}", text_tokens))
    assert not any(errors), errors
    _until_all_speak(pipeline, concurrency, thinker_done=text_tokens < TEXT_TOKENS)
    plain, beside = [], []
    for overlap, times in ((True, beside), (False, plain)):
        pipeline.steps.overlap = overlap
        for _ in range(steps):
            _sync()
            start = time.perf_counter()
            pipeline.step()
            _sync()
            times.append(time.perf_counter() - start)
    frames_before = sum(len(s.codes) for s in pipeline._speaking.values())
    phases: dict[str, list[float]] = {}
    originals = {}
    targets = {
        "Thinker step": (pipeline.thinker, "step"),
        "Talker step": (pipeline.speech_stages.talker_stage, "launch"),
        "code predictor": (pipeline.steps.handoff, "launch_frames"),
        "Talker ids read back": (pipeline.speech_stages.talker_stage, "settle"),
        "code predictor after the read-back": (pipeline.steps.handoff, "predict_isolated"),
        "Talker input rows": (pipeline.steps.handoff, "feed_text"),
        "Code2Wav": (pipeline.speech_stages.streamer, "step"),
    }
    for name, (owner, attr) in targets.items():
        originals[name] = getattr(owner, attr)
        setattr(owner, attr, _timed(phases, name, originals[name]))
    step = _timed(phases, "whole step", pipeline.step)
    for _ in range(steps):
        step()
    for name, (owner, attr) in targets.items():
        setattr(owner, attr, originals[name])
    frames = sum(len(s.codes) for s in pipeline._speaking.values()) - frames_before
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(
        activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU]
    ) as prof:
        pipeline.step()
        _sync()
    prof.export_chrome_trace(str(out_dir / f"speech_trace_c{concurrency}.json"))
    kernels = sorted((e for e in prof.key_averages() if _time(e) > 0), key=lambda e: -_time(e))
    launches = sum(e.count for e in kernels)
    gpu_idle = idle(prof)
    while pipeline.has_unfinished():
        pipeline.step()
    alone = graphs_alone(pipeline, concurrency)
    per_step = {name: statistics.median(values) * 1e3 for name, values in phases.items()}
    per_step["the rest"] = per_step["whole step"] - sum(v for k, v in per_step.items() if k != "whole step")
    return {
        "concurrency": concurrency,
        "steps": steps,
        "thinker_in_steps": text_tokens >= TEXT_TOKENS,
        "plain_step_median_ms": round(statistics.median(plain) * 1e3, 3),
        "beside_step_median_ms": round(statistics.median(beside) * 1e3, 3),
        "frames_per_step": round(frames / steps, 2),
        "phases_median_ms": {k: round(v, 3) for k, v in per_step.items()},
        "cuda_launches_one_step": launches,
        "cuda_time_one_step_ms": round(sum(_time(e) for e in kernels) / 1e3, 3),
        "gpu_idle_one_step": gpu_idle,
        "graphs_alone_ms": alone,
        "top_kernels": [
            {"name": e.key[:90], "count": e.count, "total_ms": round(_time(e) / 1e3, 3)} for e in kernels[:15]
        ],
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines += [
            f"### c = {r['concurrency']} ({r['frames_per_step']} frames per step, median of {r['steps']} steps)",
            "",
            f"Plain step: {r['plain_step_median_ms']:.2f} ms ({r['beside_step_median_ms']:.2f} ms with the Thinker's "
            f"step beside the speech stages', --overlap-stages). One step on the GPU: {r['cuda_launches_one_step']:,} "
            f"kernel launches, {r['cuda_time_one_step_ms']:.2f} ms of kernel time.",
            "",
            "| phase | median ms |",
            "| --- | --- |",
            *[f"| {k} | {v:.2f} |" for k, v in r["phases_median_ms"].items()],
            "",
            f"Thinker in the measured steps: {r['thinker_in_steps']}. GPU idle within the profiled step: "
            f"{r['gpu_idle_one_step'].get('idle_ms', 0):.2f} of {r['gpu_idle_one_step'].get('span_ms', 0):.2f} ms. "
            f"Graphs alone, back to back: {r['graphs_alone_ms']} ms.",
            "",
            "| longest gap µs | after | before |",
            "| --- | --- | --- |",
            *[
                f"| {g['us']} | `{g['after']}` | `{g['before']}` |"
                for g in r["gpu_idle_one_step"].get("longest_gaps", [])
            ],
            "",
            "| kernel | launches | total ms |",
            "| --- | --- | --- |",
            *[f"| `{k['name']}` | {k['count']} | {k['total_ms']:.3f} |" for k in r["top_kernels"]],
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--text-tokens", type=int, default=TEXT_TOKENS,
        help=f"the Thinker's forced tokens per request; below {TEXT_TOKENS} the steps are timed once it has ended",
    )  # fmt: skip
    parser.add_argument(
        "--tiny", action="store_true", help="the embedded tiny model on the CPU (a smoke run)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    where = (
        {"device": "cpu"}
        if args.tiny
        else {
            "model": str(released_skeleton()),
            "load_format": "dummy",
            "device": "cuda",
            "kv_cache_memory_gib": 16.0,
        }
    )
    config = engine_config(
        "speech profile", max_num_seqs=max(concurrencies), enforce_eager=args.enforce_eager, **where
    )
    pipeline = build_pipeline(config)
    print(pipeline.memory_summary(), flush=True)
    pipeline.add_requests(_requests(pipeline, 1, "warmup", args.text_tokens))
    while pipeline.has_unfinished():
        pipeline.step()
    out = Path(args.out_dir)
    results = [profile(pipeline, c, args.steps, args.text_tokens, out) for c in concurrencies]
    (out / "speech_profile.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "speech_profile.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
