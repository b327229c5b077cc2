"""The `omnistage` command line: serve, plan, memory-report, make-tiny, bench.

Building the parser loads only the standard library and the settings schema, so `--help` answers at once;
each command imports what it runs (torch, the server) when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from omnistage import __version__
from omnistage.cli import memory
from omnistage.cli import serve as serving
from omnistage.cli.engine_flags import add_engine_flags, add_load_flags
from omnistage.errors import OmnistageError

SERVE_DESCRIPTION = """\
Serve the OpenAI-compatible HTTP API:

  POST /v1/chat/completions      chat; text, audio and image content parts; spoken replies; streaming
  POST /v1/responses             OpenAI's Responses API over chat; previous_response_id; streaming
  GET  /v1/responses/{response_id}  a kept response (DELETE forgets it)
  POST /v1/completions           text completions; streaming
  POST /v1/audio/transcriptions  speech to text (OpenAI's multipart form; json, text, srt, vtt); streaming
  POST /v1/audio/translations    speech in any language to English text
  POST /v1/audio/speech          text to speech (mp3, opus, flac, wav, pcm); raw or SSE streaming
  GET  /v1/audio/voices          the speakers, and OpenAI's voice names for them (--voice-alias)
  GET  /v1/models                the served model
  GET  /v1/models/{model}        one model's card
  GET  /health                   200 once the engine is ready
  GET  /metrics                  Prometheus metrics (requests, latencies, KV pages)
  GET  /, /playground            the playground: a page to try the model in a browser (--no-playground)

The checkpoint's family (Qwen3-Omni, or Qwen3-ASR: transcription only) is read from its config.json.
With --ray, replicas of this server run on Ray Serve behind one endpoint (pip install 'omnistage[ray]').
Engine settings come from --config's `engine:` section, then the flags below."""


def _make_tiny(args: argparse.Namespace) -> None:
    if args.family == "qwen3-asr" and args.variant != "instruct":
        raise SystemExit("make-tiny: --variant is for --family qwen3-omni")
    if args.family == "qwen3-asr":
        from omnistage.models.qwen3_asr.tiny import make_tiny as make_asr

        path = make_asr(args.directory, seed=args.seed, layout=args.layout)
        print(f"wrote a tiny random Qwen3-ASR checkpoint ({args.layout} layout) to {path}")
        return
    if args.layout != "released":
        raise SystemExit("make-tiny: --layout hf is for --family qwen3-asr")
    from omnistage.models.qwen3_omni.tiny import make_tiny

    path = make_tiny(args.directory, seed=args.seed, variant=args.variant)
    print(f"wrote a tiny random Qwen3-Omni-{args.variant} checkpoint to {path}")


def add_ray_flags(serve: argparse.ArgumentParser) -> None:
    """`serve --ray`: replicas of the whole server on Ray Serve behind one endpoint (omnistage/ray/)."""
    ray = serve.add_argument_group("replicas on Ray Serve (pip install 'omnistage[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve replicas of this server on Ray Serve, one endpoint in front at --host:--port",
    )
    ray.add_argument("--replicas", type=int, default=1, help="replicas, fixed (default: %(default)s)")
    ray.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="scale between MIN and MAX replicas on the requests each has in flight (default: none, --replicas "
        "fixed)",
    )
    ray.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="with --autoscale: the requests in flight per replica that scaling aims at (default: %(default)s)",
    )
    ray.add_argument(
        "--ray-address",
        help="a running Ray cluster's address (default: none, Ray started on this machine for the command's life)",
    )
    ray.add_argument(
        "--replica-gpus",
        type=float,
        help="GPUs each replica takes; a fraction shares one card (default: 1 when the engine's device is a "
        "GPU, 0 on a CPU)",
    )
    ray.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default: %(default)s)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "make-tiny",
        help="write a tiny random-weight Qwen3-Omni or Qwen3-ASR checkpoint in the released layout",
    )
    tiny.add_argument("directory", help="output directory (created if missing)")
    tiny.add_argument(
        "--seed", type=int, default=0, help="random seed; the same seed writes the same files (default: 0)"
    )
    tiny.add_argument(
        "--family",
        choices=("qwen3-omni", "qwen3-asr"),
        default="qwen3-omni",
        help="model family (default: qwen3-omni)",
    )
    tiny.add_argument(
        "--variant",
        choices=("instruct", "thinking", "captioner"),
        default="instruct",
        help="which released Qwen3-Omni checkpoint: thinking and captioner are the Thinker alone, text out "
        "(default: instruct)",
    )
    tiny.add_argument(
        "--layout",
        choices=("released", "hf"),
        default="released",
        help="released: the files Qwen publishes (thinker.* names); hf: transformers' -hf conversion (Qwen3-ASR only)",
    )
    tiny.set_defaults(func=_make_tiny)

    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API: chat completions, completions, audio transcriptions, "
        "speech, models, health, metrics",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--config",
        help="YAML file with an `engine:` section; the flags below override it (default: none, the flags "
        "and the defaults below)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: none, no key asked)"
    )
    serve.add_argument(
        "--served-model-name", help="the model name clients send (default: the checkpoint's directory name)"
    )
    serve.add_argument(
        "--max-queue", type=int, help="most requests waiting for the engine; more get 503 (default: no limit)"
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=32 * 1024 * 1024, help="largest request body (default: 32 MiB)"
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="most open connections served; a request beyond them gets 503 and its connection is closed "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's line and headers may take to arrive, from the connection's opening (or "
        "the request's first byte on a kept-alive one); later, 408 and the connection is closed (default: "
        "%(default)s)",
    )
    serve.add_argument(
        "--allow-remote-media", action="store_true", help="let requests name http(s) URLs of audio and images"
    )
    serve.add_argument(
        "--media-dir",
        help="let requests name local media files under this directory (default: none, local paths are "
        "refused)",
    )
    serve.add_argument(
        "--max-video-seconds",
        type=float,
        help="the longest video a request may carry, in seconds; its stream may hold up to 60 frames a second "
        "(default: 120)",
    )
    serve.add_argument(
        "--max-video-frames",
        type=int,
        help="frames sampled from one video at most, what the vision tower sees; a request's video_max_frames "
        "may ask for fewer (default: 256)",
    )
    serve.add_argument(
        "--max-video-frame-pixels",
        type=int,
        help="the largest frame a video may have, width x height (default: 8294400, 4K)",
    )
    serve.add_argument(
        "--video-cache-mib",
        type=int,
        help="host memory (MiB) keeping videos decoded, so that a video sent again (a chat's earlier turns) is "
        "not decoded again (default: 512; 0: off)",
    )
    serve.add_argument(
        "--spoken-answers-retention-s",
        type=int,
        default=3600,
        help="seconds a spoken chat answer's transcript is kept, for a later turn to give it by its audio id "
        "(the answer's expires_at; 0: none kept) (default: %(default)s)",
    )
    serve.add_argument(
        "--max-spoken-answers",
        type=int,
        default=10_000,
        help="most spoken answers kept at once; the oldest go first (default: %(default)s)",
    )
    serve.add_argument(
        "--responses-retention-s",
        type=int,
        default=3600,
        help="seconds a Responses API response is kept, for a later request to continue it by "
        "previous_response_id or read it by GET /v1/responses/{id} (0: none kept) (default: %(default)s)",
    )
    serve.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="most Responses API responses kept at once, each with its input (media included); the oldest "
        "go first (default: %(default)s)",
    )
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="most realtime sessions (/v1/realtime) open at once; one more is refused with 429 (default: no "
        "limit but --max-connections)",
    )
    serve.add_argument(
        "--realtime-idle-timeout-s",
        type=float,
        default=600.0,
        help="seconds a realtime session may go without a client event while nothing runs; then it is "
        "closed (default: %(default)s)",
    )
    serve.add_argument(
        "--realtime-max-conversation-tokens",
        type=int,
        default=None,
        help="most tokens a realtime session's conversation may render to; a response past it fails with an "
        "error event naming the limit (default: the model's context)",
    )
    serve.add_argument(
        "--no-playground",
        dest="playground",
        action="store_false",
        help="do not serve the playground page at / and /playground (default: served)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", "qwen3"],
        help="split a reply's <think> block into reasoning_content (as vLLM's --reasoning-parser); auto: "
        "qwen3 for a Qwen3-Omni checkpoint without a Talker (Thinking, Captioner), none otherwise (default: "
        "%(default)s)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default: %(default)s)",
    )
    add_engine_flags(serve)
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine in a process of its own: HTTP work and model steps no longer share one GIL "
        "(c=16 decode is faster), but the first token of a lone request comes ~10 ms later (H200, "
        "benchmarks/RESULTS.md); by default it runs on a thread of the server's process",
    )
    add_ray_flags(serve)
    serve.set_defaults(func=serving.run)

    loading = {  # the commands that load a checkpoint as serve would, report on its memory, and exit
        "plan": (
            memory.plan,
            "load a checkpoint as serve would (on its devices, under its memory cap), print each device's "
            "memory plan and what is captured or eager, and exit",
        ),
        "memory-report": (
            memory.report,
            "load a checkpoint as serve would, then print where each GPU's memory went (torch's allocator "
            "snapshot grouped by what holds it: weights, KV pages, buffers, graph pools per stage, the "
            "allocator's cache, what nothing accounts for), and exit",
        ),
    }
    for name, (func, text) in loading.items():
        command = sub.add_parser(name, help=text)
        add_load_flags(command)
        command.set_defaults(func=func)

    from omnistage.bench import a2t, speech, video_speech

    bench = sub.add_parser(
        "bench",
        help="benchmarks: a2t (audio-to-text speed), t2s, s2s and v2s (speech out: first packet, RTF)",
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    a2t.add_parser(benchmarks)
    speech.add_parsers(benchmarks)
    video_speech.add_parser(benchmarks)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except OmnistageError as exc:
        print(f"omnistage: error: {exc}", file=sys.stderr)
        return 2
    return 0
