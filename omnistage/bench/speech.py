"""`omnistage bench t2s` and `omnistage bench s2s`: how fast omnistage speaks.

Per request, from its arrival (before its prompt is laid out):
- first audio packet: to the first output that carries PCM (in-process: a RequestOutput with a non-empty
  `audio_delta`; over HTTP: the first SSE chunk whose `delta.audio` carries data);
- RTF: wall seconds to its end over seconds of audio it produced (lower is better; 0.1 speaks ten times
  faster than real time);
and per pass, the audio seconds produced per wall second over all its requests. A pass runs
max(c, --requests) requests, at most c at once, for each concurrency c of the sweep.

Workloads: t2s, a text chat turn whose reply is written and spoken; s2s, a 5 s clip as the user's turn
(`bench/clips.py`), the reply spoken; `t2s --tts`, the text spoken exactly as `/v1/audio/speech` does
(`SpeechParams.reply_token_ids`: the Thinker's layers do not run). Every request's input is its own (a clip
with a faint dither numbered by the request, a text opening with its number: `SpeechInput.as_request`), so
the prefix cache and the audio tower's cache serve none of it (a run against a server numbers itself too); the
run reports what they served (`caches_served`, from the pipeline or the server's /metrics). Targets:
- this process (`--model DIR`, or `--load-format dummy`: random weights at the released sizes): an
  AsyncPipeline over the pipeline;
- a running server (`--url`): streamed chat with `modalities: ["text", "audio"]` and pcm16 audio, or
  `/v1/audio/speech` with `stream_format: "sse"` for `--tts`;
- `--baseline transformers` (in-process, c=1): `generate(return_audio=True)` on our very weights; it does
  not stream audio, so its first packet is its whole time.

Random weights never end a reply or its audio, so lengths are forced: the Thinker writes exactly
--text-tokens tokens (max = min, ignore_eos, greedy) and the Talker speaks exactly --frames codec frames
(12.5 per second of audio; max = min, ignore_eos, the released sampling otherwise). Over HTTP only the cap
can be sent (`max_frames`), so each request's frames are read from its usage and reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from omnistage.bench import builds, caches, speech_engine
from omnistage.bench.caches import cache_counts, served_since
from omnistage.bench.clients import first_model, http_pool
from omnistage.bench.speech_targets import (
    FRAMES_PER_SECOND,
    Runner,
    SpeechInput,
    SpeechTiming,
    inprocess_runner,
    server_runner,
    speech_inputs,
)
from omnistage.bench.stats import json_safe, median, percentile, stage_lines
from omnistage.bench.sweep import run as run_async
from omnistage.bench.sweep import sweep as generic_sweep

log = logging.getLogger("omnistage.bench")

DEFAULT_TEXT_TOKENS = 40
DEFAULT_FRAMES = 125  # 10 s


def summarize(timings: list[SpeechTiming], walls: list[float], concurrency: int) -> dict[str, Any]:
    """The numbers of `len(walls)` equal passes at `concurrency`; `timings` holds every request of every pass.

    Audio seconds per second is each pass's audio over its wall time, the median pass's; first packet, RTF
    and latency are over all requests.
    """
    if not walls or len(timings) % len(walls):
        raise ValueError(f"{len(timings)} requests do not split into {len(walls)} equal passes")
    size = len(timings) // len(walls)
    passes = [timings[i * size : (i + 1) * size] for i in range(len(walls))]
    throughput = [sum(t.audio_s for t in p) / w for p, w in zip(passes, walls)]
    ms = 1e3
    summary: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": size,
        "passes": len(walls),
        "wall_s": round(median(walls), 4),
        "audio_s": round(sum(t.audio_s for t in passes[0]), 3),
        "audio_s_per_s": round(median(throughput), 3),
        "first_packet_median_ms": round(median([t.first_packet_s for t in timings]) * ms, 2),
        "first_packet_p90_ms": round(percentile([t.first_packet_s for t in timings], 90) * ms, 2),
        "rtf_median": round(median([t.rtf for t in timings]), 4),
        "rtf_p90": round(percentile([t.rtf for t in timings], 90), 4),
        "latency_median_ms": round(median([t.latency_s for t in timings]) * ms, 2),
        "frames": sorted({t.frames for t in timings}),
        "text_tokens": sorted({t.text_tokens for t in timings}),
    }
    if len(walls) > 1:
        summary["audio_s_per_s_per_pass"] = [round(x, 3) for x in throughput]
    names = list(timings[0].stages) if timings else []
    if names:
        summary["stages_median_ms"] = {
            name: round(median([t.stages.get(name, math.nan) for t in timings]) * ms, 2) for name in names
        }
    return summary


async def sweep(
    run: Runner,
    inputs: list[SpeechInput],
    concurrencies: list[int],
    min_requests: int = 4,
    warmup: int = 1,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """`repeats` passes of max(c, min_requests) requests cycling over `inputs`, per concurrency c."""
    return await generic_sweep(
        run, inputs, concurrencies, summarize, lambda c: max(c, min_requests), warmup, repeats
    )


# -- the command ---------------------------------------------------------------------------------------------


def _concurrencies(text: str) -> list[int]:
    return [int(c) for c in str(text).split(",")]


def run_speech(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The whole benchmark as `omnistage bench t2s|s2s` runs it: one result per workload run, written under
    --out-dir as each part ends (a run cut short keeps what it measured)."""
    workloads = {args.workload: _concurrencies(args.concurrency)}
    if args.also:
        workloads[args.also] = _concurrencies(args.also_concurrency)
    forced = not args.natural
    common = {"text_tokens": args.text_tokens, "frames": args.frames, "forced": forced, "voice": args.voice}
    inputs = {w: speech_inputs(w, args.seed, None if args.espeak else False) for w in workloads}
    results: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        tts = args.tts and workload == "t2s"
        results[workload] = {
            "workload": workload + (" --tts (/v1/audio/speech)" if tts else ""),
            "tts": tts,
            **common,
            "inputs": [{"name": i.name, "text": i.text} for i in inputs[workload]],
        }
    if args.url:
        model = args.served_model or first_model(args.url, args.api_key)
        for workload, concurrencies in workloads.items():
            result = results[workload]
            result["target"] = {"url": args.url, "model": model}
            before, cached = builds.on_server(args.url), caches.on_server(args.url)
            result["ours"] = run_async(
                _over_http(args, model, workload, inputs[workload], concurrencies, forced)
            )
            result["builds_while_serving"] = builds.on_server(args.url) - before
            result["caches_served"] = served_since(cached, caches.on_server(args.url))
            save(args, results)
        return results

    pipeline, engine, engine_info = speech_engine.start_engine(
        args, max(c for cs in workloads.values() for c in cs)
    )
    try:
        for workload, concurrencies in workloads.items():
            result = results[workload]
            result |= engine_info
            run = inprocess_runner(
                engine, args.tts and workload == "t2s", args.text_tokens, args.frames, args.voice, forced
            )
            cached = cache_counts(pipeline.stats())
            result["ours"] = run_async(
                sweep(run, inputs[workload], concurrencies, args.requests, args.warmup, args.repeats)
            )
            result["caches_served"] = served = served_since(cached, cache_counts(pipeline.stats()))
            log.info("%s: served from the caches during the run: %s", workload, served)
            result["builds_while_serving"] = builds.in_process()
            result["pools_after"] = after = speech_engine.pools(pipeline.stats())
            log.info("%s: pools after the run: %s", workload, after)
            save(args, results)
        if args.baseline == "transformers":
            _transformers(pipeline, results, inputs, args)
    finally:
        engine.shutdown()
    return results


def _transformers(
    pipeline: Any,
    results: dict[str, dict[str, Any]],
    inputs: dict[str, list[SpeechInput]],
    args: argparse.Namespace,
) -> None:
    from omnistage.bench.hf_speech import build_hf_omni, run_hf_speech

    config_dict = json.loads((Path(pipeline.model_path) / "config.json").read_text())
    hf, sources = build_hf_omni(pipeline, config_dict)
    for workload, items in inputs.items():
        timings = run_hf_speech(
            hf, pipeline.processor, items, args.text_tokens, args.frames, args.voice, args.baseline_requests
        )
        summary = summarize(timings, [sum(t.latency_s for t in timings)], 1)
        summary["towers"] = sources
        summary["note"] = (
            "generate(return_audio=True), one request at a time; it returns the audio when all is done, so its "
            "first packet is its whole time; wall = sum of latencies"
        )
        results[workload]["transformers"] = summary
        save(args, results)


async def _over_http(
    args: argparse.Namespace,
    model: str,
    workload: str,
    inputs: list[SpeechInput],
    concurrencies: list[int],
    forced: bool,
) -> list[dict[str, Any]]:
    async with http_pool(args.url, args.api_key, max(concurrencies)) as client:
        tts = args.tts and workload == "t2s"
        run = server_runner(client, model, tts, args.text_tokens, args.frames, args.voice, forced)
        return await sweep(run, inputs, concurrencies, args.requests, args.warmup, args.repeats)


def report(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of every workload's passes, ours and (when run) transformers'."""
    lines = []
    for result in results.values():
        forced = "forced" if result["forced"] else "at most"
        text = "the text as given" if result["tts"] else f"{forced} {result['text_tokens']} text tokens"
        lines += [
            f"{result['workload']}: {text} and {forced} {result['frames']} frames "
            f"({result['frames'] / FRAMES_PER_SECOND:g} s of audio) per request, voice {result['voice']}",
            "",
            "| target | c | requests | first packet median ms | p90 ms | RTF median | RTF p90 | audio s/s | frames |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        rows = [("ours", p) for p in result.get("ours") or []]
        if "transformers" in result:
            rows.append(("transformers (not streamed)", result["transformers"]))
        for name, p in rows:
            lines.append(
                f"| {name} | {p['concurrency']} | {p['requests']} | {p['first_packet_median_ms']:.1f} | "
                f"{p['first_packet_p90_ms']:.1f} | {p['rtf_median']:.3f} | {p['rtf_p90']:.3f} | "
                f"{p['audio_s_per_s']:.2f} | {','.join(map(str, p['frames']))} |"
            )
        lines += stage_lines(result.get("ours") or [], "from arrival")
        if "pools_after" in result:
            lines.append(f"\npools after the run (free, total pages): {result['pools_after']}")
        lines.append("")
    return "\n".join(lines)


def save(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """Each workload's results as JSON under --out-dir (t2s.json, t2s_tts.json, s2s.json), if given."""
    if not args.out_dir:
        return
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for workload, result in results.items():
        path = out / f"{workload}{'_tts' if result['tts'] else ''}.json"
        path.write_text(json.dumps(json_safe(result), indent=2) + "\n")
        log.info("wrote %s", path)


def main(args: argparse.Namespace) -> None:
    if args.baseline and args.url:
        raise SystemExit(f"omnistage bench {args.workload}: --baseline runs in-process; drop --url")
    if args.baseline and args.tts:
        raise SystemExit(
            f"omnistage bench {args.workload}: transformers has no text-to-speech path (its generate always "
            "runs the Thinker); drop --tts or --baseline"
        )
    results = run_speech(args)
    print(report(results))
    empty = [w for w, r in results.items() if not r.get("pools_after", {"full": True})["full"]]
    if empty:
        raise SystemExit(f"omnistage bench: pages still held after the {', '.join(empty)} run")
    for result in results.values():
        builds.check(args, result.get("builds_while_serving", []))


def add_parsers(sub: Any) -> None:
    """`omnistage bench t2s ...` and `omnistage bench s2s ...` under the `bench` subcommand's subparsers."""
    for workload, summary in (
        ("t2s", "text to speech: first audio packet, RTF, audio seconds per second"),
        ("s2s", "speech to speech (a 5 s clip in): first audio packet, RTF, audio seconds per second"),
    ):
        p = sub.add_parser(workload, help=summary, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        p.set_defaults(func=main, workload=workload)
        _add_options(p, workload)


def _add_options(p: argparse.ArgumentParser, workload: str) -> None:
    other = "s2s" if workload == "t2s" else "t2s"
    target = p.add_argument_group("target")
    target.add_argument("--url", help="a running server's base URL (http://host:port); else in-process")
    target.add_argument("--served-model", help="the model name the server serves (default: its first)")
    target.add_argument("--api-key", help="with --url: the server's API key (default: none)")
    speech_engine.add_engine_options(target)
    target.add_argument("--baseline", choices=["transformers"],
                        help="also time transformers' generate(return_audio=True) on the same weights, c=1")  # fmt: skip
    target.add_argument("--baseline-requests", type=int, default=2,
                        help="requests transformers runs, one at a time (default: %(default)s)")  # fmt: skip
    if workload == "t2s":
        p.add_argument("--tts", action="store_true",
                       help="speak the text exactly, as /v1/audio/speech does (the Thinker's layers do not run)")  # fmt: skip
    else:
        p.set_defaults(tts=False)
    p.add_argument("--also", choices=[other],
                   help=f"then run {other} in the same process (one weight load), at --also-concurrency")  # fmt: skip
    p.add_argument("--also-concurrency", default="1", help="(default: %(default)s)")
    p.add_argument("--concurrency", default="1,4,16,32",
                   help="one concurrency or a sweep (default: %(default)s)")  # fmt: skip
    p.add_argument("--requests", type=int, default=4,
                   help="a pass runs max(c, N) requests (default: %(default)s)")  # fmt: skip
    p.add_argument("--text-tokens", type=int, default=DEFAULT_TEXT_TOKENS,
                   help="text tokens of each reply (default: %(default)s)")  # fmt: skip
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES,
                   help="codec frames of each reply, 12.5 per second of audio (default: %(default)s, 10 s)")  # fmt: skip
    p.add_argument("--natural", action="store_true",
                   help="let the model end text and audio itself: --text-tokens and --frames become caps")  # fmt: skip
    p.add_argument("--voice", default="ethan", help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesised clips (default: %(default)s)")
    p.add_argument("--no-espeak", dest="espeak", action="store_false",
                   help="synthesise speech-like clips even where espeak-ng is installed")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1, help="requests run before timing (default: %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed passes per concurrency (default: %(default)s)"
    )
    p.add_argument("--out-dir", help="write each workload's results as JSON here (t2s.json, s2s.json)")
    builds.add_argument(p)
