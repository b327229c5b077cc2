"""The `omnistage` command line: serve, plan, memory-report, make-tiny, bench.

Building the parser loads only the standard library and the settings schema, so `--help` answers at once;
each command imports what it runs (torch, the server) when it runs.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from omnistage import __version__
from omnistage.errors import ConfigError, OmnistageError

if TYPE_CHECKING:
    from omnistage.config import EngineConfig

SERVE_DESCRIPTION = """\
Serve the OpenAI-compatible HTTP API:

  POST /v1/chat/completions      chat; text, audio and image content parts; spoken replies; streaming
  POST /v1/completions           text completions; streaming
  POST /v1/audio/transcriptions  speech to text (OpenAI's multipart form); streaming
  POST /v1/audio/speech          text to speech (mp3, opus, flac, wav, pcm); raw or SSE streaming
  GET  /v1/models                the served model
  GET  /v1/models/{model}        one model's card
  GET  /health                   200 once the engine is ready
  GET  /metrics                  Prometheus metrics (requests, latencies, KV pages)

The checkpoint's family (Qwen3-Omni, or Qwen3-ASR: transcription only) is read from its config.json.
Engine settings come from --config's `engine:` section, then the flags below."""


def _make_tiny(args: argparse.Namespace) -> None:
    if args.family == "qwen3-asr":
        from omnistage.models.qwen3_asr.tiny import make_tiny as make_asr

        path = make_asr(args.directory, seed=args.seed, layout=args.layout)
        print(f"wrote a tiny random Qwen3-ASR checkpoint ({args.layout} layout) to {path}")
        return
    if args.layout != "released":
        raise SystemExit("make-tiny: --layout hf is for --family qwen3-asr")
    from omnistage.models.qwen3_omni.tiny import make_tiny

    path = make_tiny(args.directory, seed=args.seed)
    print(f"wrote a tiny random Qwen3-Omni checkpoint to {path}")


# Engine settings the command line can override: (flag, EngineConfig key, type, help). None means "not given",
# so the YAML file's value (or the schema's default) stands.
# fmt: off
_ENGINE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "checkpoint directory (default: the embedded tiny random-weight model)"),
    ("--load-format", "load_format", str, "dummy: random weights at the checkpoint's sizes"),
    ("--device", "device", str, "where the model runs; auto takes a GPU when there is one"),
    ("--dtype", "dtype", str, "weight and activation type; auto: bfloat16 on a GPU, float32 on a CPU"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--num-kv-pages", "num_kv_pages", int, "fixed KV pool size in pages (default: planned from memory)"),
    ("--kv-cache-memory-gib", "kv_cache_memory_gib", float,
     "memory for KV pages (default: 0.25 GiB on a CPU, all that is left on a GPU)"),
    ("--gpu-memory-limit-gib", "gpu_memory_limit_gib", float,
     "cap on the GPU memory omnistage plans to use (default: the whole device)"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences running at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int,
     "per-step token budget; a longer prefill runs in chunks"),
    ("--max-model-len", "max_model_len", int, "context limit (default: the model's)"),
    ("--max-num-speaking", "max_num_speaking", int,
     "most speaking requests in flight; more wait their turn (default: the Talker max_batch on a GPU; eager: at most the Code2Wav streams)"),
    ("--max-graph-batch", "max_graph_batch", int, "largest decode batch captured in a CUDA graph"),
    ("--max-prefill-graph-tokens", "max_prefill_graph_tokens", int,
     "largest prefill step (tokens) captured in a CUDA graph; 0 for none"),
    ("--moe-kernel", "moe_kernel", str,
     "GPU MoE kernel; auto: Triton for decode-sized batches, grouped GEMMs above"),
    ("--seed", "seed", int, "seed of the random weights of --load-format dummy"),
    ("--admission-window-ms", "admission_window_ms", float,
     "longest an idle engine holds a request for others its server is still preparing (0: never)"),
    ("--max-tokens-default", "max_tokens_default", int,
     "max_tokens of a request that gives none (default: up to the context; 256 on the embedded model)"),
]
# fmt: on


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """--config's `engine:` section with the engine flags on top."""
    from omnistage.config import engine_config, load_config

    overrides = {key: getattr(args, key) for _, key, _, _ in _ENGINE_FLAGS}
    overrides["enforce_eager"] = args.enforce_eager
    overrides["compile"] = False if args.no_compile else None
    overrides["overlap_stages"] = True if args.overlap_stages else None
    overrides["decode_ahead"] = False if args.no_decode_ahead else None
    if args.config:
        return load_config(args.config, **overrides)
    return engine_config("command line", **{k: v for k, v in overrides.items() if v is not None})


def _plan(args: argparse.Namespace) -> None:
    """Load the checkpoint as serve would, print what it planned for each device and captured, and exit."""
    from omnistage.pipeline.family import build_pipeline

    pipeline = build_pipeline(_engine_config(args))
    _print_plans(pipeline)
    print(pipeline.memory_summary())


def _print_plans(pipeline: object) -> None:
    from omnistage.engine.memory.plan import MemoryPlan
    from omnistage.engine.memory.report import reachable

    plans = [obj for _, obj in reachable(pipeline) if isinstance(obj, MemoryPlan)]
    for plan in plans:
        print(plan.table())
    if not plans:
        print("no GPU plan: the engine runs on the CPU")


def _memory_report(args: argparse.Namespace) -> None:
    """Load the checkpoint as serve would, and print where each device's memory went, grouped by what holds it."""
    import torch

    from omnistage.engine.memory.report import accounting_table, group_snapshot, holdings
    from omnistage.pipeline.family import build_pipeline

    pipeline = build_pipeline(_engine_config(args))
    _print_plans(pipeline)
    held = holdings(pipeline)
    if not any(h.device is not None for h in held):
        print(
            "no CUDA: the stages run on the CPU, where torch's allocator keeps no snapshot; what they hold, "
            "by their own accounting:"
        )
        print(accounting_table(held))
        print(pipeline.memory_summary())
        return
    segments = torch.cuda.memory_snapshot()
    devices = {segment["device"] for segment in segments}
    for report in group_snapshot(segments, held, {d: torch.cuda.mem_get_info(d) for d in devices}):
        print(report.table())
    cpu = [h for h in held if h.device is None]
    if cpu:
        print("on the CPU, by the stages' own accounting:")
        print(accounting_table(cpu))
    print(pipeline.memory_summary())


def _serve(args: argparse.Namespace) -> None:
    config = _engine_config(args)
    name = args.served_model_name or (Path(config.model).resolve().name if config.model else "omnistage-tiny")

    media_dir = Path(args.media_dir).resolve() if args.media_dir else None
    if media_dir is not None and not media_dir.is_dir():
        raise ConfigError(f"--media-dir {args.media_dir}: not a directory")
    if args.header_timeout <= 0:
        raise ConfigError(f"--header-timeout {args.header_timeout}: must be above 0 seconds")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections {args.max_connections}: must be at least 1")

    listener = bind(args.host, args.port)
    try:
        _load_and_serve(args, config, name, media_dir, listener)
    finally:
        listener.close()


def _load_and_serve(
    args: argparse.Namespace, config: EngineConfig, name: str, media_dir: Path | None, listener: socket.socket
) -> None:
    import uvicorn

    from omnistage.media import MediaPolicy
    from omnistage.pipeline.async_pipeline import AsyncPipeline
    from omnistage.server import build_app
    from omnistage.server.http_protocol import with_header_timeout

    media = MediaPolicy(allow_remote=args.allow_remote_media, media_dir=media_dir)
    if args.engine_process:  # the server's torch work is then per request, on worker threads
        import torch

        from omnistage.pipeline.engine_process import ONE_THREAD

        torch.set_num_threads(ONE_THREAD)
    pipeline = AsyncPipeline.from_config(config, max_queue=args.max_queue, engine_process=args.engine_process)
    try:
        app = build_app(pipeline, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes, media=media)
        logging.getLogger("omnistage.serve").info(
            "serving '%s' at http://%s:%d/v1 (API key %s, max queue %s, max %d connections, header timeout "
            "%g s)\n  %s",
            name,
            args.host,
            listener.getsockname()[1],
            "required" if args.api_key else "off",
            args.max_queue if args.max_queue is not None else "unbounded",
            args.max_connections,
            args.header_timeout,
            pipeline.memory_summary(),
        )
        http_config = uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            http=with_header_timeout(args.header_timeout),
            # uvicorn answers 503 once its open connections (the asking one among them) or running requests
            # reach the limit: N + 1 serves N connections.
            limit_concurrency=args.max_connections + 1,
        )
        server = uvicorn.Server(http_config)
        server.run(sockets=[listener])
    finally:
        pipeline.shutdown()


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a busy port fails at once, not after minutes of
    loading, and nothing can take the port while the model loads (asyncio starts listening on it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # A restarted server may bind while its predecessor's connections linger in TIME_WAIT, as uvicorn does.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} is in use on {host}; stop what holds it or choose another --port"
            ) from None
        raise ConfigError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The _ENGINE_FLAGS, with the schema's default in their help and its choices where it has some."""
    from omnistage.config import EngineConfig

    for flag, key, kind, help_text in _ENGINE_FLAGS:
        field = EngineConfig.model_fields[key]
        literal = typing.get_origin(field.annotation) is typing.Literal
        default = "" if field.default is None else f" (default: {field.default})"
        parser.add_argument(
            flag,
            dest=key,
            type=kind,
            default=None,  # not given: the YAML file's value, else the schema's default, stands
            choices=typing.get_args(field.annotation) if literal else None,
            help=help_text + default,
        )


def _add_switches(parser: argparse.ArgumentParser) -> None:
    """The engine's on/off flags, beside its valued ones (`_add_engine_flags`)."""
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="run without CUDA graphs")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave the decoder layers uncompiled on a GPU"
    )
    parser.add_argument(
        "--overlap-stages",
        action="store_true",
        help="on a GPU, run the Thinker's decode steps beside the speech stages' (off by default: README)",
    )
    parser.add_argument(
        "--no-decode-ahead",
        action="store_true",
        help="read each decode step's tokens back before launching the next (default: launch it first)",
    )


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that loads the checkpoint as serve would."""
    parser.add_argument("--config", help="YAML file with an `engine:` section; the flags below override it")
    _add_engine_flags(parser)
    _add_switches(parser)


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
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default: %(default)s)",
    )
    _add_engine_flags(serve)
    _add_switches(serve)
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine in a process of its own: HTTP work and model steps no longer share one GIL "
        "(c=16 decode is faster), but the first token of a lone request comes ~10 ms later (H200, "
        "benchmarks/RESULTS.md); by default it runs on a thread of the server's process",
    )
    serve.set_defaults(func=_serve)

    plan = sub.add_parser(
        "plan",
        help="load a checkpoint as serve would (on its devices, under its memory cap), print each device's "
        "memory plan and what is captured or eager, and exit",
    )
    _add_load_flags(plan)
    plan.set_defaults(func=_plan)

    report = sub.add_parser(
        "memory-report",
        help="load a checkpoint as serve would, then print where each GPU's memory went (torch's allocator "
        "snapshot grouped by what holds it: weights, KV pages, buffers, graph pools per stage, the allocator's "
        "cache, what nothing accounts for), and exit",
    )
    _add_load_flags(report)
    report.set_defaults(func=_memory_report)

    from omnistage.bench import a2t, speech

    bench = sub.add_parser(
        "bench", help="benchmarks: a2t (audio-to-text speed), t2s and s2s (speech out: first packet, RTF)"
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    a2t.add_parser(benchmarks)
    speech.add_parsers(benchmarks)
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


if __name__ == "__main__":
    sys.exit(main())
