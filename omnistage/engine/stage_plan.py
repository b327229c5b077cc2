"""An LLM stage's memory at start on a GPU: measure its floor and its graphs' costs with the runner, warm the
runner up, and let `capture_plan.plan_memory` split what is left between graphs and KV pages.

The measuring lives here and in the runner (`profile_peak`, `warm_up`); the stage only asks for the plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from omnistage.config import EngineConfig
from omnistage.engine.capture_plan import (
    NO_OTHER_STAGES,
    GiB,
    MemoryPlan,
    StageMemory,
    decode_buckets,
    plan_memory,
    prefill_buckets,
)
from omnistage.engine.encoder_engine import EncoderEngine
from omnistage.engine.model_runner import ModelRunner
from omnistage.errors import ConfigError

log = logging.getLogger(__name__)


def plan_stage_memory(
    runner: ModelRunner,
    encoders: EncoderEngine,
    cfg: EngineConfig,
    kv_bytes_per_page: int,
    max_prompt_tokens: int,
    max_media: tuple[int, int],
    others: StageMemory = NO_OTHER_STAGES,
) -> MemoryPlan:
    """Measure the floor (the largest of the stage's text prefill step, the largest steps of the `others` on
    this device, and the encoders' largest inputs, `max_media` = most audios and images per prompt), price
    the graphs, warm up, then plan. A runner not in bfloat16 gets no graphs (the grouped-GEMM MoE needs it)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks this process freed while loading are free for the plan too
    weights = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    log.info(
        "after loading: %.2f GiB allocated by this process, %.2f GiB free on the device (%.2f GiB held by "
        "other processes or the driver)",
        weights / GiB,
        free / GiB,
        (total - free - torch.cuda.memory_reserved(device)) / GiB,
    )
    limit = int(cfg.gpu_memory_limit_gib * GiB) if cfg.gpu_memory_limit_gib else None
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    floor = encoders.profile_floor(
        runner.profile_peak(cfg.max_num_batched_tokens, 1),
        cfg.max_num_batched_tokens,
        max_prompt_tokens,
        *max_media,
    )
    floor = replace(floor, other_stages=others.peaks)
    buckets = [] if cfg.enforce_eager else decode_buckets(min(cfg.max_graph_batch, cfg.max_num_seqs))
    costs = {}
    if buckets:
        # a graph keeps its step's activations and logits in the shared pool; scale the largest step's
        # measured peak by batch (conservative: graphs captured largest-first reuse that memory)
        costs = scaled_costs(runner.profile_peak(max(buckets), max(buckets)), buckets)
    prefill_costs = {}
    max_prefill = min(cfg.max_prefill_graph_tokens, cfg.max_num_batched_tokens)
    if not cfg.enforce_eager and max_prefill:
        prefill = prefill_buckets(max_prefill)
        prefill_costs = scaled_costs(runner.profile_peak(max(prefill), 1), prefill)
    runner.warm_up(cfg.max_num_batched_tokens)
    plan = plan_memory(
        total, free, weights, floor, kv_bytes_per_page, costs, limit=limit, prefill_graph_costs=prefill_costs
    )
    plan = replace(plan, resident=others.resident)
    fixed = cfg.num_kv_pages
    if fixed is None and cfg.kv_cache_memory_gib is not None:
        fixed = int(cfg.kv_cache_memory_gib * GiB) // kv_bytes_per_page
    if fixed is not None:
        if fixed > plan.kv_pages:
            raise ConfigError(
                f"{fixed:,} KV pages were asked for but only {plan.kv_pages:,} fit:\n{plan.table()}"
            )
        plan = replace(plan, kv_pages=fixed, free=plan.free + (plan.kv_pages - fixed) * kv_bytes_per_page)
    if runner.dtype != torch.bfloat16 and (plan.captured_buckets or plan.prefill_captured):
        log.warning("CUDA graphs need bfloat16 (grouped-GEMM MoE); %s steps run eagerly", runner.dtype)
        plan = replace(
            plan,
            captured_buckets=(),
            skipped_buckets=tuple(sorted(plan.graph_costs)),
            prefill_captured=(),
            prefill_skipped=tuple(sorted(plan.prefill_graph_costs)),
        )
    log.info("%s", plan.table())
    return plan


def scaled_costs(largest_peak: int, buckets: list[int]) -> dict[int, int]:
    """Graph memory per bucket: the largest bucket's measured step peak scaled by size, plus 2 MiB."""
    return {b: -(-largest_peak * b // max(buckets)) + (2 << 20) for b in buckets}
