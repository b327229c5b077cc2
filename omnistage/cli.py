"""The `omnistage` command line: serve, make-tiny, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from omnistage.errors import ConfigError, OmnistageError


def _make_tiny(args: argparse.Namespace) -> None:
    from omnistage.models.qwen3_omni.tiny import make_tiny

    path = make_tiny(args.directory, seed=args.seed)
    print(f"wrote a tiny random Qwen3-Omni checkpoint to {path}")


# Engine settings the command line can override: (flag, EngineConfig key, type, help). None means "not given",
# so the YAML file's value (or the schema's default) stands.
_ENGINE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "checkpoint directory (default: the embedded tiny random-weight model)"),
    ("--load-format", "load_format", str, "safetensors, or dummy: random weights at the checkpoint's sizes"),
    ("--device", "device", str, "auto, cpu or cuda (default: auto)"),
    ("--dtype", "dtype", str, "auto, float32, bfloat16 or float16 (default: auto)"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--num-kv-pages", "num_kv_pages", int, "fixed KV pool size in pages (default: planned from memory)"),
    ("--kv-cache-memory-gib", "kv_cache_memory_gib", float, "memory for KV pages"),
    ("--gpu-memory-limit-gib", "gpu_memory_limit_gib", float, "cap on the GPU memory omnistage plans to use"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences running at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "per-step token budget (chunked prefill)"),
    ("--max-model-len", "max_model_len", int, "context limit (default: the model's)"),
    ("--max-graph-batch", "max_graph_batch", int, "largest decode batch captured in a CUDA graph"),
    ("--max-prefill-graph-tokens", "max_prefill_graph_tokens", int,
     "largest one-sequence prefill chunk captured in a CUDA graph (0: none)"),  # fmt: skip
    ("--moe-kernel", "moe_kernel", str, "GPU MoE kernel: auto, grouped_mm or triton"),
    ("--seed", "seed", int, "seed of the random weights of --load-format dummy"),
]


def _serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    import uvicorn

    from omnistage.config import engine_config, load_config
    from omnistage.engine.async_engine import AsyncEngine
    from omnistage.media import MediaPolicy
    from omnistage.server import build_app

    overrides = {key: getattr(args, key) for _, key, _, _ in _ENGINE_FLAGS}
    overrides["enforce_eager"] = args.enforce_eager
    overrides["compile"] = False if args.no_compile else None
    if args.config:
        config = load_config(args.config, **overrides)
    else:
        config = engine_config("command line", **{k: v for k, v in overrides.items() if v is not None})
    name = args.served_model_name or (Path(config.model).resolve().name if config.model else "omnistage-tiny")

    media_dir = Path(args.media_dir).resolve() if args.media_dir else None
    if media_dir is not None and not media_dir.is_dir():
        raise ConfigError(f"--media-dir {args.media_dir}: not a directory")
    media = MediaPolicy(allow_remote=args.allow_remote_media, media_dir=media_dir)

    log = logging.getLogger("omnistage.serve")
    engine = AsyncEngine.from_config(config, max_queue=args.max_queue)
    try:
        app = build_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes, media=media)
        log.info(
            "serving '%s' at http://%s:%d/v1 (API key %s, max queue %s)\n  %s",
            name,
            args.host,
            args.port,
            "required" if args.api_key else "off",
            args.max_queue if args.max_queue is not None else "unbounded",
            engine.engine.memory_summary(),
        )
        uvicorn.run(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
    finally:
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "make-tiny", help="write a tiny random-weight Qwen3-Omni checkpoint in the released layout"
    )
    tiny.add_argument("directory", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same files")
    tiny.set_defaults(func=_make_tiny)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (chat, completions, models)")
    serve.add_argument("--config", help="YAML file with an `engine:` section; the flags below override it")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*")
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
        "--allow-remote-media", action="store_true", help="let requests name http(s) URLs of audio and images"
    )
    serve.add_argument("--media-dir", help="let requests name local media files under this directory")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    for flag, key, kind, help_text in _ENGINE_FLAGS:
        serve.add_argument(flag, dest=key, type=kind, default=None, help=help_text)
    serve.add_argument("--enforce-eager", action="store_true", default=None, help="run without CUDA graphs")
    serve.add_argument("--no-compile", action="store_true", help="leave the decoder layers uncompiled on a GPU")
    serve.set_defaults(func=_serve)

    from omnistage.bench import a2t

    bench = sub.add_parser("bench", help="benchmarks: a2t (audio-to-text speed)")
    a2t.add_parser(bench.add_subparsers(dest="benchmark", required=True))
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
