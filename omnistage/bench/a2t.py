"""`omnistage bench a2t`: audio-to-text speed, as input-audio seconds per wall second (the real-time factor).

Every clip is transcribed once per pass (a concurrency above the number of clips cycles over the set
whole times, so that `c` requests are in flight), at most `c` requests in flight, for each concurrency of
the sweep. Such a pass is one burst: c requests start together and end nearly together, so its wall time
holds a ramp up and a tail. `--rounds R` runs at least R·c requests a pass (whole times over the set), each
finished request's slot taken by the next at once: with R of 8 or more a pass measures the steady state
that a serving benchmark at a fixed concurrency reports. A pass reports the real-time factor (all clips' audio seconds / the pass's wall seconds) and the
TTFT and TPOT medians. Targets:

- a running server (`--url`): chat completions with `input_audio` (streamed; TTFT is the first chunk,
  which the server sends once the first token exists) or `/v1/audio/transcriptions` (streamed events); the
  body (the clip's base64, its JSON) is encoded before the clock starts;
- this process (`--model DIR`, or `--load-format dummy` for random weights at the released sizes): the
  engine behind an AsyncPipeline, from the preprocessing on; TTFT when the consumer gets the first token (as a
  client gets its first chunk), TPOT from each RequestOutput's metrics;
- `--baseline transformers` (in-process only): transformers' Thinker on the same weights and clips.

Each request sends its clip as its own (a faint dither numbered by the request over its first half second,
`Clip.heard_as`), so the audio tower's cache and the prefix cache serve it nothing a fresh recording would not
get (a run against a server numbers itself too); what they served is reported (`caches_served`: the pipeline's
counters in-process, the server's /metrics over HTTP; near zero but a shared template's first page).

Random weights say nothing useful at the end of a sentence, so `--output-tokens N` forces every request
to exactly N tokens (max_tokens = min_tokens = N, ignore_eos). The targets' requests are in a2t_targets.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

from omnistage.bench import builds, caches
from omnistage.bench.a2t_targets import Runner, inprocess_runner, server_runner
from omnistage.bench.baseline import BASELINE_KV_GIB, kv_beside_baseline
from omnistage.bench.caches import cache_counts, served_since
from omnistage.bench.clients import auth, first_model, http_pool
from omnistage.bench.clips import SYNTH_SETS, Clip, load_dir, synth_clips, total_seconds
from omnistage.bench.skeletons import SKELETONS, released_skeleton
from omnistage.bench.sse_client import StreamClient
from omnistage.bench.stats import json_safe, stage_lines, summarize
from omnistage.bench.sweep import run as run_async
from omnistage.bench.sweep import sweep as generic_sweep

log = logging.getLogger("omnistage.bench")

DEFAULT_DUMMY_OUTPUT_TOKENS = 33  # the issue's reference point: a 5 s clip answered with 33 tokens


async def sweep(
    run: Runner,
    clips: list[Clip],
    concurrencies: list[int],
    warmup: int = 1,
    repeats: int = 1,
    rounds: int = 1,
) -> list[dict]:
    """`repeats` passes per concurrency, each over the clips as many whole times as `rounds`·c requests
    need; each concurrency's summary (see summarize)."""
    return await generic_sweep(
        run, clips, concurrencies, summarize, count=lambda c: passes_for(rounds * c, len(clips)) * len(clips),
        warmup=warmup, repeats=repeats,
    )  # fmt: skip


def passes_for(requests: int, clips: int) -> int:
    """Whole times over the set one pass takes to hold at least `requests` requests."""
    return max(1, math.ceil(requests / clips))


# -- targets -----------------------------------------------------------------------------------------------


# -- the command ---------------------------------------------------------------------------------------------


def load_clips(args: argparse.Namespace) -> list[Clip]:
    if args.clips:
        clips = load_dir(args.clips)
    else:
        durations = SYNTH_SETS[args.synth or "librispeech"]
        clips = synth_clips(durations, seed=args.seed, espeak=None if args.espeak else False)
    if args.limit:
        clips = clips[: args.limit]
    log.info("%d clips, %.1f s of audio", len(clips), total_seconds(clips))
    return clips


def run_a2t(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark as `omnistage bench a2t` runs it; returns what it writes as JSON."""
    clips = load_clips(args)
    concurrencies = [int(c) for c in str(args.concurrency).split(",")]
    output_tokens = args.output_tokens
    results: dict[str, Any] = {
        "clips": [{"name": c.name, "seconds": round(c.seconds, 3)} for c in clips],
        "audio_s": round(total_seconds(clips), 3),
        "output_tokens": output_tokens,
        "rounds": args.rounds,
    }
    if args.url:
        model = args.served_model or first_model(args.url, args.api_key)
        results["target"] = {
            "url": args.url,
            "model": model,
            "endpoint": args.endpoint,
            "client": args.http_client,
        }
        before, cached = builds.on_server(args.url), caches.on_server(args.url)
        results["ours"] = run_async(_over_http(args, model, clips, concurrencies, output_tokens))
        results["builds_while_serving"] = builds.on_server(args.url) - before
        results["caches_served"] = served_since(cached, caches.on_server(args.url))
        return results

    from omnistage.config import engine_config
    from omnistage.pipeline.async_pipeline import AsyncPipeline
    from omnistage.pipeline.family import build_pipeline

    model_dir = args.model or (str(released_skeleton(args.skeleton)) if args.load_format == "dummy" else None)
    if output_tokens is None and args.load_format == "dummy":
        output_tokens = results["output_tokens"] = DEFAULT_DUMMY_OUTPUT_TOKENS
    overrides = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": max(concurrencies),
        "kv_cache_memory_gib": kv_beside_baseline(args.kv_cache_memory_gib, bool(args.baseline), args.device),
        "enforce_eager": args.enforce_eager or None,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_graph_tokens": args.max_prefill_graph_tokens,
        "max_audio_graph_windows": args.max_audio_graph_windows,
        "admission_hold_steps": args.admission_hold_steps,
        "admission_window_ms": args.admission_window_ms,
        "stream_interval": args.stream_interval,
    }
    config = engine_config(
        "bench a2t",
        model=model_dir,
        load_format=args.load_format,
        speech=False,  # text out: a Talker's weights and pages stay off the GPU
        **{k: v for k, v in overrides.items() if v is not None},
    )
    started = time.perf_counter()
    if args.engine_process:  # as `serve --engine-process`: this process prepares, a second one steps
        import torch

        from omnistage.pipeline.engine_process import ONE_THREAD

        torch.set_num_threads(ONE_THREAD)
        engine = AsyncPipeline.from_config(config, engine_process=True)
    else:
        pipeline = build_pipeline(config)
        engine = AsyncPipeline(pipeline)
    results["engine_start_s"] = round(time.perf_counter() - started, 2)
    results["engine_process"] = args.engine_process
    results["count_preparing"] = args.count_preparing
    results["target"] = {"model": str(engine.frontend.model_path), "load_format": args.load_format}
    results["engine"] = engine.memory_summary()
    try:
        run = inprocess_runner(engine, output_tokens, args.max_tokens, args.count_preparing)
        cached = cache_counts(engine.stats())
        results["ours"] = run_async(sweep(run, clips, concurrencies, args.warmup, args.repeats, args.rounds))
        results["caches_served"] = served_since(cached, cache_counts(engine.stats()))
        results["builds_while_serving"] = (
            engine.stats()["builds_while_serving"] if args.engine_process else builds.in_process()
        )
        if args.baseline == "transformers":
            results["transformers"] = _transformers(
                pipeline.thinker, clips, output_tokens, args.max_tokens, args.repeats
            )
    finally:
        engine.shutdown()
    return results


def _transformers(
    llm_engine: Any, clips: list[Clip], output_tokens: int | None, max_tokens: int, repeats: int
) -> dict:
    from omnistage.bench.hf_baseline import build_hf_thinker, omni_features, run_hf
    from omnistage.bench.hf_layout import audio_tower
    from omnistage.models.qwen3_omni.transcription import transcription_messages

    config_dict = json.loads((Path(llm_engine.model_path) / "config.json").read_text())
    processor, device = llm_engine.processor, llm_engine.device
    if config_dict.get("model_type") == "qwen3_asr":
        from omnistage.bench.hf_asr import asr_features, build_hf_asr

        hf = build_hf_asr(llm_engine, config_dict)
        prompts = [processor.transcription(clip.audio, None, None).token_ids for clip in clips]
        features, sources = asr_features(hf, device), {"audio_tower": "shared with ours"}
    else:
        hf, sources = build_hf_thinker(llm_engine, config_dict)
        messages = [transcription_messages(clip.audio, None, None) for clip in clips]
        prompts = [processor.process_chat(m).token_ids for m in messages]
        features = partial(omni_features, dtype=audio_tower(hf).dtype, device=device)
    eos = processor.tokenizer.token_to_id("<|im_end|>")
    summary = run_hf(hf, eos, clips, prompts, features, output_tokens, max_tokens, device, repeats)
    summary["towers"] = sources
    return summary


async def _over_http(
    args: argparse.Namespace,
    model: str,
    clips: list[Clip],
    concurrencies: list[int],
    output_tokens: int | None,
) -> list[dict]:
    url = args.url.rstrip("/")
    if args.http_client == "h11":
        client = StreamClient(url, auth(args.api_key))
        try:
            run = server_runner(client, model, args.endpoint, output_tokens, args.max_tokens)
            return await sweep(run, clips, concurrencies, args.warmup, args.repeats, args.rounds)
        finally:
            client.close()
    async with http_pool(url, args.api_key, max(concurrencies)) as httpx_client:
        run = server_runner(httpx_client, model, args.endpoint, output_tokens, args.max_tokens)
        return await sweep(run, clips, concurrencies, args.warmup, args.repeats, args.rounds)


def report(results: dict[str, Any]) -> str:
    """A markdown table of every pass, ours and (when run) transformers' at c=1."""
    lines = [
        f"{len(results['clips'])} clips, {results['audio_s']:.1f} s of audio, "
        f"output tokens {results['output_tokens'] or 'natural'}",
        "",
        "| target | c | RTF (x real time) | TTFT median ms | TPOT median ms | wall s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("ours", "transformers"):
        passes = results.get(name)
        for p in [passes] if isinstance(passes, dict) else passes or []:
            lines.append(
                f"| {name} | {p['concurrency']} | {p['rtf']:.2f} | {p['ttft_median_ms']:.1f} | "
                f"{p['tpot_median_ms']:.2f} | {p['wall_s']:.2f} |"
            )
    lines += stage_lines(results.get("ours") or [], "to the first token")
    if "caches_served" in results:
        lines.append(f"served from the caches during the run: {results['caches_served']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    if args.baseline and args.url:
        raise SystemExit("omnistage bench a2t: --baseline runs in-process; drop --url")
    if args.engine_process and (args.url or args.baseline):
        raise SystemExit("omnistage bench a2t: --engine-process is in-process, without --url or --baseline")
    results = run_a2t(args)
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps(json_safe(results), indent=2) + "\n")
        log.info("wrote %s", args.out)
    builds.check(args, results.get("builds_while_serving", []))


def add_parser(sub: Any) -> None:
    """`omnistage bench a2t ...` under the `bench` subcommand's subparsers."""
    p = sub.add_parser("a2t", help="audio-to-text speed: real-time factor, TTFT, TPOT", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    clips = p.add_mutually_exclusive_group()
    clips.add_argument(
        "--clips", help="a directory of .wav/.flac clips (a same-named .txt is its transcript)"
    )
    clips.add_argument("--synth", choices=sorted(SYNTH_SETS),
                       help="synthesise clips with these durations (default: librispeech, 20 clips, 94 s; "
                            "5s: one 5 s clip)")  # fmt: skip
    p.add_argument("--no-espeak", dest="espeak", action="store_false",
                   help="synthesise speech-like signals even where espeak-ng is installed")  # fmt: skip
    p.add_argument("--limit", type=int, help="use only the first N clips")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesised clips (default: %(default)s)")
    target = p.add_argument_group("target")
    target.add_argument("--url", help="a running server's base URL (http://host:port); else in-process")
    target.add_argument(
        "--endpoint",
        choices=["chat", "transcriptions"],
        default="chat",
        help="with --url (default: %(default)s)",
    )
    target.add_argument("--served-model", help="the model name the server serves (default: its first)")
    target.add_argument("--api-key", help="with --url: the server's API key (default: none)")
    target.add_argument(
        "--http-client",
        choices=["h11", "httpx"],
        default="h11",
        help="with --url: h11, a thin client on asyncio streams (omnistage/bench/sse_client.py), or httpx "
        "(its layers added ~2 ms to a lone request's first token on the H200's host) (default: %(default)s)",
    )
    target.add_argument(
        "--model", help="in-process: checkpoint directory (default: released sizes when dummy)"
    )
    target.add_argument(
        "--skeleton",
        choices=list(SKELETONS),
        default="qwen3-omni",
        help="with --load-format dummy and no --model: the released sizes of (default: %(default)s)",
    )
    target.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="in-process (default: %(default)s)",
    )
    target.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="in-process (default: the engine's, auto)"
    )
    target.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="in-process (default: the engine's, auto)",
    )
    target.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        help=f"in-process (default: the engine's; {BASELINE_KV_GIB:g} with --baseline)",
    )
    target.add_argument("--enforce-eager", action="store_true")
    target.add_argument("--max-num-batched-tokens", type=int,
                        help="in-process: the tokens a step computes at most (default: the engine's)")  # fmt: skip
    target.add_argument("--max-prefill-graph-tokens", type=int,
                        help="largest prefill chunk captured in a CUDA graph (0: none; default: the engine's)")  # fmt: skip
    target.add_argument("--max-audio-graph-windows", type=int,
                        help="largest audio tower call captured in a CUDA graph, in 8 s windows' worth of "
                             "chunks (0: none, the tower eager; default: the engine's)")  # fmt: skip
    target.add_argument("--admission-hold-steps", type=int,
                        help="in-process: steps a busy engine holds its arrivals (default: the engine's)")  # fmt: skip
    target.add_argument("--admission-window-ms", type=float,
                        help="in-process: how long an idle engine holds a burst for the requests still being "
                             "prepared (default: the engine's)")  # fmt: skip
    target.add_argument("--count-preparing", action="store_true",
                        help="in-process: count each request as being prepared until it goes in, as the server "
                             "does, so that an idle engine holds a burst for its last request (off: each goes in "
                             "as it comes, as in earlier runs)")  # fmt: skip
    target.add_argument("--stream-interval", type=int,
                        help="in-process: a streamed reply's tokens per output (default: the engine's, 4 for "
                             "Qwen3-ASR)")  # fmt: skip
    target.add_argument("--engine-process", action="store_true",
                        help="in-process: the engine steps in a process of its own, as `serve --engine-process` "
                             "runs it; this process prepares the requests")  # fmt: skip
    target.add_argument(
        "--baseline", choices=["transformers"], help="also time transformers on the same weights"
    )
    p.add_argument(
        "--concurrency", default="1", help="one concurrency or a sweep, e.g. 1,4,16 (default: %(default)s)"
    )
    p.add_argument("--output-tokens", type=int,
                   help=f"force exactly N output tokens (default with dummy weights: {DEFAULT_DUMMY_OUTPUT_TOKENS})")  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=256, help="cap on natural (unforced) outputs (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=1,
                   help="requests a pass holds, as a multiple of c (whole times over the set): 1 is one "
                        "burst, 8 or more the steady state (default: %(default)s)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1, help="requests run before timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes per concurrency (and for the baseline); figures are their medians (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", help="write the results as JSON here")
    builds.add_argument(p)
    p.set_defaults(func=main)
