"""`omnistage bench v2s`: how fast omnistage answers a video with its sound, in speech.

Videos per length (--video-seconds) at --resolution are written once into a temporary directory, one for each
request the run sends: a picture sliding across a colour field of its own at --source-fps frames a second, a
tone of its own for its sound track (`video_targets`), so that no request finds another's video in the prefix
cache or its sound in the audio tower's (what they served is reported: `caches_served`). Each request sends
its video as the server takes it, a `video_url` under the media directory with `use_audio_in_video`, and its
reply is written and spoken. Per length and concurrency c (max(c, --requests)
requests, at most c at once, after --warmup requests of that length), from the request's arrival:
- TTFT: to the Thinker's first text token, and its pieces: `decode` (the file read, frames sampled, the
  sound track resampled), `preprocess` (the processor's layout: patches, mel features, positions),
  `encoded` (the towers have run), each from arrival;
- first audio packet, RTF (wall seconds to the end per second of audio spoken) and audio seconds per second,
  as `omnistage bench t2s` measures them.
With --follow-up each request is timed as a conversation's second turn about its video (the first turn's
question, a fixed answer, a new question), its first turn sent just before it and not timed: the videos the
server keeps decoded, the towers' rows in the encoder cache and both prefix caches then serve what the turns
share, as they do for a chat that sends its video with every turn.
Frames are sampled at the processor's 2 a second; a length whose prompt would not leave --text-tokens within
the context is sampled at 1, then 0.5 (reported as its fps), unless --video-fps fixes the rate.

Random weights never end a reply, so lengths are forced as t2s forces them: exactly --text-tokens text tokens
(ignore_eos, min_tokens, greedy) and --frames codec frames. `--baseline transformers` times transformers'
generate(return_audio=True, use_audio_in_video=True) on the same weight tensors, one request at a time, fed
our decoder's and processor's output (`hf_video`); lengths over --baseline-max-seconds or that run out of
memory are skipped with a note. The run fails (non-zero exit) when a length failed or pages stayed held.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.bench import builds, speech, speech_engine
from omnistage.bench.caches import cache_counts, served_since
from omnistage.bench.speech_targets import FRAMES_PER_SECOND, SpeechTiming
from omnistage.bench.stats import json_safe, median, percentile
from omnistage.bench.sweep import run as run_async
from omnistage.bench.sweep import sweep

if TYPE_CHECKING:  # the benchmark's own imports load torch; `--help` must not (tests/unit/test_cli.py)
    from omnistage.bench.video_targets import VideoInput
    from omnistage.media import MediaPolicy

log = logging.getLogger("omnistage.bench")

STAGES = ("decode", "preprocess", "encoded", "first_text_token")


def summarize(timings: list[SpeechTiming], walls: list[float], concurrency: int) -> dict[str, Any]:
    """t2s's figures of the passes (`speech.summarize`) and the TTFT, the first text token's median and p90."""
    summary = speech.summarize(timings, walls, concurrency)
    ttft = [t.stages.get("first_text_token", math.nan) for t in timings]
    summary["ttft_median_ms"] = round(median(ttft) * 1e3, 2)
    summary["ttft_p90_ms"] = round(percentile(ttft, 90) * 1e3, 2)
    return summary


def _numbers(text: str, kind: type) -> list:
    return [kind(x) for x in str(text).split(",")]


def parse_resolution(text: str) -> tuple[int, int]:
    """ "1280x720" as (width, height)."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 2 or int(height) < 2:
        raise ValueError(f"resolution {text!r} is not WIDTHxHEIGHT")
    return int(width), int(height)


def run_v2s(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark: one engine, then per length its sweep (and transformers' requests), written
    under --out-dir as each part ends."""
    from omnistage.bench.video_targets import fitting_fps, inprocess_runner, sample_rates, write_videos
    from omnistage.media import VIDEO_CACHE_MIB, DecodedVideos, MediaPolicy

    concurrencies = _numbers(args.concurrency, int)
    forced = not args.natural
    result: dict[str, Any] = {
        "workload": "v2s",
        "resolution": "x".join(map(str, args.resolution)),
        "source_fps": args.source_fps,
        "text_tokens": args.text_tokens,
        "frames": args.frames,
        "forced": forced,
        "voice": args.voice,
        "follow_up": args.follow_up,
        "lengths": [],
    }
    pipeline, engine, engine_info = speech_engine.start_engine(args, max(concurrencies))
    result |= engine_info
    try:
        with tempfile.TemporaryDirectory(prefix="omnistage-v2s-") as tmp:
            began = time.perf_counter()

            def count(c: int) -> int:  # the requests of a pass
                return max(c, args.requests)

            files = args.warmup + args.repeats * sum(count(c) for c in concurrencies)
            videos = write_videos(
                _numbers(args.video_seconds, float),
                args.resolution,
                Path(tmp),
                args.source_fps,
                args.seed,
                files,
            )
            result["videos_written_s"] = round(time.perf_counter() - began, 2)
            # videos kept decoded only for a conversation's turns: distinct requests must each decode their own
            kept = DecodedVideos(VIDEO_CACHE_MIB << 20 if args.follow_up else 0)
            policy = MediaPolicy(media_dir=Path(tmp), decoded_videos=kept)
            first_turns: list[SpeechTiming] = []  # with --follow-up, the timed requests' first turns
            run = inprocess_runner(
                engine, policy, args.text_tokens, args.frames, args.voice, forced, args.follow_up, first_turns
            )
            processor, context = engine.frontend.processor, engine.frontend.max_model_len
            cfg = policy.video_processing
            rates = sample_rates(cfg.fps, cfg.temporal_patch_size, args.video_fps)
            items = []
            for video in videos:
                item, tokens = fitting_fps(video, processor, policy, context, args.text_tokens, rates)
                items.append(item)
                entry: dict[str, Any] = {"name": item.name, "seconds": item.seconds, "fps": item.fps,
                                         "prompt_tokens": tokens, "file_mb": round(item.path.stat().st_size / 1e6, 2)}  # fmt: skip
                result["lengths"].append(entry)
                cached = cache_counts(pipeline.stats())
                try:
                    entry["ours"] = run_async(
                        sweep(run, [item], concurrencies, summarize, count, args.warmup, args.repeats)
                    )
                except Exception as exc:  # one length's failure is its result; the others still run
                    log.exception("%s failed", item.name)
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["caches_served"] = served_since(cached, cache_counts(pipeline.stats()))
                if first_turns:  # one at a time before each second turn: no pass wall of their own
                    entry["first_turns"] = summarize(first_turns, [sum(t.latency_s for t in first_turns)], 1)
                    first_turns.clear()
                save(args, result)
            result["builds_while_serving"] = builds.in_process()
            result["pools_after"] = speech_engine.pools(pipeline.stats())
            save(args, result)
            if args.baseline == "transformers":
                _transformers(pipeline, result, items, policy, args)
    finally:
        engine.shutdown()
    return result


def _transformers(
    pipeline: Any,
    result: dict[str, Any],
    items: list[VideoInput],
    policy: MediaPolicy,
    args: argparse.Namespace,
) -> None:
    import torch

    from omnistage.bench.hf_speech import build_hf_omni
    from omnistage.bench.hf_video import run_hf_video

    config_dict = json.loads((Path(pipeline.model_path) / "config.json").read_text())
    hf, sources = build_hf_omni(pipeline, config_dict)
    for item, entry in zip(items, result["lengths"]):
        if args.baseline_max_seconds is not None and item.seconds > args.baseline_max_seconds:
            entry["transformers"] = {
                "skipped": f"longer than --baseline-max-seconds {args.baseline_max_seconds:g}"
            }
            save(args, result)
            continue
        try:
            timings = run_hf_video(hf, pipeline.processor, policy, item, args.text_tokens, args.frames,
                                   args.voice, args.baseline_requests)  # fmt: skip
        except torch.cuda.OutOfMemoryError as exc:
            entry["transformers"] = {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
        except Exception as exc:  # transformers' failure on one length is a note beside ours
            log.exception("transformers: %s failed", item.name)
            entry["transformers"] = {"skipped": f"{type(exc).__name__}: {exc}"}
        else:
            summary = summarize(timings, [sum(t.latency_s for t in timings)], 1)
            summary["towers"] = sources
            summary["note"] = (
                "generate(return_audio=True, use_audio_in_video=True), one request at a time, fed our decoded "
                "frames and patches; it returns the audio when all is done, so its first packet is its whole "
                "time; wall = sum of latencies"
            )
            entry["transformers"] = summary
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save(args, result)


def report(result: dict[str, Any]) -> str:
    """A markdown table of every length's passes, ours and (where run) transformers', then the TTFT pieces."""
    forced = "forced" if result["forced"] else "at most"
    lines = [
        f"v2s: {result['resolution']} videos with their sound, {forced} {result['text_tokens']} text tokens "
        f"and {result['frames']} frames ({result['frames'] / FRAMES_PER_SECOND:g} s of audio) per request, "
        f"voice {result['voice']}; engine start {result['engine_start_s']:.1f} s, videos written in "
        f"{result.get('videos_written_s', math.nan):.1f} s",
        "",
        "| video | fps | prompt tokens | target | c | requests | TTFT median ms | first packet median ms | "
        "first packet p90 ms | RTF median | audio s/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pieces = []
    for entry in result["lengths"]:
        head = f"| {entry['seconds']:g} s | {entry['fps']:g} | {entry['prompt_tokens']} |"
        if "error" in entry:
            lines.append(f"{head} ours | FAILED: {entry['error']} |")
        turn = "ours, second turn" if result.get("follow_up") else "ours"
        rows = [(turn, p) for p in entry.get("ours") or []]
        if "first_turns" in entry:
            rows.append(("ours, first turn", entry["first_turns"]))
        hf = entry.get("transformers")
        if hf and "skipped" not in hf:
            rows.append(("transformers (not streamed)", hf))
        for name, p in rows:
            lines.append(
                f"{head} {name} | {p['concurrency']} | {p['requests']} | {p['ttft_median_ms']:.1f} | "
                f"{p['first_packet_median_ms']:.1f} | {p['first_packet_p90_ms']:.1f} | {p['rtf_median']:.3f} | "
                f"{p['audio_s_per_s']:.2f} |"
            )
        if hf and "skipped" in hf:
            lines.append(f"{head} transformers | skipped: {hf['skipped']} |")
        for name, p in rows:
            if "stages_median_ms" not in p:
                continue
            stages = p["stages_median_ms"]
            named = ", ".join(f"{k} {stages[k]:.1f}" for k in STAGES if k in stages)
            pieces.append(
                f"{name}, {entry['seconds']:g} s, c={p['concurrency']}, from arrival (median ms): {named}"
            )
        if "caches_served" in entry:
            pieces.append(f"ours, {entry['seconds']:g} s, served from the caches: {entry['caches_served']}")
    lines += ["", *pieces]
    if "pools_after" in result:
        lines.append(f"\npools after the run (free, total pages): {result['pools_after']}")
    return "\n".join(lines) + "\n"


def save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The results as JSON, v2s.json under --out-dir, if given."""
    if not args.out_dir:
        return
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "v2s.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")


def main(args: argparse.Namespace) -> None:
    result = run_v2s(args)
    print(report(result))
    failed = [e["name"] for e in result["lengths"] if "error" in e]
    if failed:
        raise SystemExit(f"omnistage bench v2s: {', '.join(failed)} failed (see v2s.json and the log)")
    if not result["pools_after"]["full"]:
        raise SystemExit("omnistage bench v2s: pages still held after the run")
    builds.check(args, result["builds_while_serving"])


def add_parser(sub: Any) -> None:
    """`omnistage bench v2s ...` under the `bench` subcommand's subparsers."""
    p = sub.add_parser("v2s", help="video with its sound to speech: TTFT, first audio packet, RTF",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.set_defaults(func=main, workload="v2s")
    target = p.add_argument_group("target (in-process)")
    speech_engine.add_engine_options(target)
    target.add_argument("--baseline", choices=["transformers"],
                        help="also time transformers' generate(return_audio=True) on the same weights, c=1")  # fmt: skip
    target.add_argument("--baseline-requests", type=int, default=1,
                        help="requests transformers runs per length, one at a time (default: %(default)s)")  # fmt: skip
    target.add_argument("--baseline-max-seconds", type=float,
                        help="skip transformers on longer videos (default: try every length)")  # fmt: skip
    video = p.add_argument_group("videos")
    video.add_argument("--video-seconds", default="10,30,120", help="lengths (default: %(default)s)")
    video.add_argument("--resolution", type=parse_resolution, default="1280x720",
                       help="WIDTHxHEIGHT (default: %(default)s)")  # fmt: skip
    video.add_argument("--source-fps", type=int, default=2,
                       help="frames a second written into each file (default: %(default)s)")  # fmt: skip
    video.add_argument("--video-fps", type=float,
                       help="frames sampled a second (default: the processor's, lower where the context needs)")  # fmt: skip
    p.add_argument("--concurrency", default="1,8", help="one concurrency or a sweep (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1,
                   help="a pass runs max(c, N) requests (default: %(default)s)")  # fmt: skip
    p.add_argument("--text-tokens", type=int, default=speech.DEFAULT_TEXT_TOKENS,
                   help="text tokens of each reply (default: %(default)s)")  # fmt: skip
    p.add_argument("--frames", type=int, default=speech.DEFAULT_FRAMES,
                   help="codec frames of each reply, 12.5 per second of audio (default: %(default)s, 10 s)")  # fmt: skip
    p.add_argument("--natural", action="store_true",
                   help="let the model end text and audio itself: --text-tokens and --frames become caps")  # fmt: skip
    p.add_argument("--voice", default="ethan", help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic videos (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests of each length run before timing it (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=1, help="timed passes per concurrency (default: %(default)s)"
    )
    p.add_argument("--follow-up", action="store_true",
                   help="time each request as a conversation's second turn about its video, its first turn run "
                   "untimed just before it: the videos kept decoded, the towers' rows and the prefix pages serve "
                   "what the turns share")  # fmt: skip
    p.add_argument("--out-dir", help="write the results as JSON here (v2s.json)")
    builds.add_argument(p)
