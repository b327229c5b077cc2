"""The speech benchmarks' in-process target: its engine built from the target options, and those options
(`omnistage bench t2s/s2s/v2s`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from omnistage.bench.baseline import BASELINE_KV_GIB, kv_beside_baseline
from omnistage.bench.skeletons import released_skeleton


def start_engine(args: argparse.Namespace, max_num_seqs: int) -> tuple[Any, Any, dict[str, Any]]:
    """The in-process target of the target options: its pipeline, an AsyncPipeline over it, and what its start
    showed (seconds, model, memory summary)."""
    from omnistage.config import engine_config, load_config
    from omnistage.pipeline.async_pipeline import AsyncPipeline
    from omnistage.pipeline.family import build_pipeline

    model_dir = args.model or (str(released_skeleton()) if args.load_format == "dummy" else None)
    overrides = {
        "model": model_dir,
        "load_format": args.load_format,
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": max_num_seqs,
        "kv_cache_memory_gib": kv_beside_baseline(args.kv_cache_memory_gib, bool(args.baseline), args.device),
        "enforce_eager": args.enforce_eager or None,
        "overlap_stages": True if args.overlap_stages else None,
        "flash_prefill": False if args.no_flash_prefill else None,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "talker_max_num_batched_tokens": args.talker_max_num_batched_tokens,
        "gpu_memory_limit_gib": args.gpu_memory_limit_gib,
        "moe_kernel": args.moe_kernel,
        "long_prefill_kernel": args.long_prefill_kernel,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if args.config:  # the file's settings, the flags above on top (as `omnistage serve --config`)
        config = load_config(args.config, **given)
    else:
        config = engine_config(f"bench {args.workload}", **given)
    started = time.perf_counter()
    pipeline = build_pipeline(config)
    engine = AsyncPipeline(pipeline)
    engine_info = {
        "engine_start_s": round(time.perf_counter() - started, 2),
        "target": {"model": str(engine.frontend.model_path), "load_format": args.load_format},
        "engine": engine.memory_summary(),
    }
    return pipeline, engine, engine_info


def pools(stats: dict[str, int]) -> dict[str, Any]:
    """Every stage's KV pages, free / total, and whether all are free."""
    pools = {
        "thinker": [stats["kv_pages_free"], stats["kv_pages_total"]],
        "talker": [stats.get("talker_kv_pages_free", 0), stats.get("talker_kv_pages_total", 0)],
    }
    return {**pools, "full": all(free == total for free, total in pools.values())}


def add_engine_options(target: Any) -> None:
    """The in-process target's options (`start_engine` reads them) into the argument group `target`."""
    target.add_argument(
        "--model", help="in-process: checkpoint directory (default: released sizes when dummy)"
    )
    target.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                        help="in-process (default: %(default)s)")  # fmt: skip
    target.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="in-process (default: the engine's)"
    )
    target.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="in-process (default: the engine's)")  # fmt: skip
    target.add_argument("--kv-cache-memory-gib", type=float,
                        help=f"in-process: the Thinker's KV pool (default: the engine's; {BASELINE_KV_GIB:g} with --baseline)")  # fmt: skip
    target.add_argument("--enforce-eager", action="store_true", help="in-process: no CUDA graphs")
    target.add_argument("--overlap-stages", action="store_true",
                        help="in-process: the Thinker's decode steps beside the speech stages' (off by default)")  # fmt: skip
    target.add_argument("--no-flash-prefill", action="store_true",
                        help="in-process: long prompt chunks on the paged kernel, not torch's FlashAttention")  # fmt: skip
    target.add_argument("--config",
                        help="in-process: a topology YAML file, as `omnistage serve --config` takes (the flags here on top)")  # fmt: skip
    target.add_argument("--gpu-memory-limit-gib", type=float,
                        help="in-process: cap on the GPU memory the plan uses (default: the engine's)")  # fmt: skip
    target.add_argument("--max-num-batched-tokens", type=int,
                        help="in-process: the per-step token budget, a long prompt's chunk (default: the engine's)")  # fmt: skip
    target.add_argument("--talker-max-num-batched-tokens", type=int,
                        help="in-process: the Talker's own per-step budget (default: --max-num-batched-tokens)")  # fmt: skip
    target.add_argument("--moe-kernel", choices=["auto", "grouped_mm", "triton"],
                        help="in-process: the GPU MoE kernel (default: the engine's)")  # fmt: skip
    target.add_argument("--long-prefill-kernel", choices=["flash", "triton"],
                        help="in-process: long prompt chunks' kernel over their gathered keys (default: the engine's)")  # fmt: skip
