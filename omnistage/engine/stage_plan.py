"""An LLM stage's memory at start on a GPU: read what the device offers, measure the stage's floor and its
graphs' costs with the runner, warm the runner up, and let `capture_plan.plan_device` split what is left
between the graphs and KV pages of this stage and of the others on the device (`others`).

The measuring lives here and in the runner (`profile_peak`, `warm_up`); the stage only asks for the plan.
`read_device` is what a device without an LLM stage (the speech device of the two-GPU topology) reads
before the pipeline plans it with `plan_device`.
"""

from __future__ import annotations

import logging

import torch

from omnistage.config import EngineConfig, Graphs
from omnistage.engine.buckets import decode_buckets, prefill_buckets
from omnistage.engine.capture_plan import (
    MAIN_POOL,
    NO_OTHER_STAGES,
    DeviceMemory,
    GiB,
    GraphCandidates,
    KVPool,
    MemoryPlan,
    StageMemory,
    plan_device,
)
from omnistage.engine.encoder_engine import EncoderEngine
from omnistage.engine.gpu_memory import graph_candidates, scaled_peaks
from omnistage.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def read_device(device: torch.device, limit_gib: float | None) -> DeviceMemory:
    """What `device` offers this process now that the stages placed on it are loaded; caps the caching
    allocator there at `limit_gib` (gpu_memory_limit), which the plan then fills."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks this process freed while loading are free for the plan too
    allocated = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    log.info(
        "after loading: %.2f GiB allocated on %s by this process, %.2f GiB free (%.2f GiB held by other "
        "processes or the driver)",
        allocated / GiB,
        device,
        free / GiB,
        (total - free - torch.cuda.memory_reserved(device)) / GiB,
    )
    limit = int(limit_gib * GiB) if limit_gib else None
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    return DeviceMemory(total=total, free=free, allocated=allocated, limit=limit, name=str(device))


def plan_stage_memory(
    runner: ModelRunner,
    encoders: EncoderEngine,
    cfg: EngineConfig,
    kv_bytes_per_page: int,
    max_prompt_tokens: int,
    max_media: tuple[int, int],
    others: StageMemory = NO_OTHER_STAGES,
    stage: str = "Thinker",
) -> MemoryPlan:
    """Measure the floor (the stage's text prefill step and its encoders on their largest inputs, `max_media` =
    most audios and images per prompt; the `others` on this device bring their own steps), price the graphs,
    warm up, then plan the device. The stage's KV pool is fixed by the config or holds at least one request
    of the longest length. A runner not in bfloat16 gets no graphs (the grouped-GEMM MoE needs it)."""
    device = read_device(runner.device, cfg.gpu_memory_limit_gib)
    floor = encoders.profile_floor(
        runner.profile_peak(cfg.max_num_batched_tokens, 1).bytes,
        cfg.max_num_batched_tokens,
        max_prompt_tokens,
        *max_media,
    )
    graphs: tuple[GraphCandidates, ...] = ()
    if not cfg.enforce_eager and runner.dtype != torch.bfloat16:
        log.warning("CUDA graphs need bfloat16 (grouped-GEMM MoE); %s steps run eagerly", runner.dtype)
    elif not cfg.enforce_eager:
        graphs = _graph_candidates(runner, cfg, stage) + _encoder_candidates(encoders, cfg)
    runner.warm_up(cfg.max_num_batched_tokens)
    fixed = cfg.num_kv_pages
    if fixed is None and cfg.kv_cache_memory_gib is not None:
        fixed = int(cfg.kv_cache_memory_gib * GiB) // kv_bytes_per_page
    resident = [
        (stage, _bytes(runner.model), "weights"),
        ("audio encoder", _bytes(encoders.audio_encoder), "weights"),
    ]
    if encoders.vision_encoder is not None:
        resident.append(("vision encoder", _bytes(encoders.vision_encoder), "weights"))
    own = StageMemory(
        resident=tuple(resident),
        peaks=tuple(floor.phases()),
        kv=(
            KVPool(
                stage, kv_bytes_per_page, min_pages=-(-(max_prompt_tokens + 1) // cfg.page_size), pages=fixed
            ),
        ),
        graphs=graphs,
    )
    plan = plan_device(device, [own, others])
    log.info("%s", plan.table())
    return plan


def _graph_candidates(runner: ModelRunner, cfg: EngineConfig, stage: str) -> tuple[GraphCandidates, ...]:
    """The stage's decode and prefill graphs as the config's stages section sizes them (none when eager)."""
    # a graph keeps its outputs (hidden states, logits) in its pool and shares the rest (scratch) with the
    # pool's other graphs; the largest step's measured peak, scaled by batch
    thinker = cfg.stage("thinker")
    graphs = []
    if buckets := thinker.graphs.sizes(decode_buckets):
        peaks = scaled_peaks(runner.profile_peak(max(buckets), max(buckets)), buckets)
        graphs.append(graph_candidates(stage, "decode", "batch", peaks, pool=stage))
    if prefill := thinker.prefill_graphs.sizes(prefill_buckets):
        # the largest holds as many sequences as it may (`graphs.StaticPrefillBuffers`): a burst of prompts
        peaks = scaled_peaks(runner.profile_peak(max(prefill), min(max(prefill), thinker.max_batch)), prefill)
        graphs.append(graph_candidates(stage, "prefill", "tokens", peaks, pool=MAIN_POOL))
    return tuple(graphs)


def _encoder_candidates(encoders: EncoderEngine, cfg: EngineConfig) -> tuple[GraphCandidates, ...]:
    """The towers' graphs (audio per bucket of windows, vision per bucket of patches): the configured buckets,
    else the encoders' defaults. Prefill-kind: a request pays for them once, not per token. They are captured
    into the device's main-stream pool (`MAIN_POOL`), with the LLM stage's prefill graphs."""
    stage = cfg.stage("encoders")
    if stage.enforce_eager:
        return ()
    default_audio, default_vision = encoders.default_graph_buckets()

    def sizes(graphs: Graphs, default: list[int]) -> list[int]:
        return graphs.sizes(lambda top: [b for b in default if b <= top], max(default, default=0))

    audio, vision = sizes(stage.audio_graphs, default_audio), sizes(stage.vision_graphs, default_vision)
    peaks = encoders.graph_costs(audio, vision)
    towers = (
        ("audio encoder", "windows", peaks.get("audio")),
        ("vision encoder", "patches", peaks.get("vision")),
    )
    return tuple(
        graph_candidates(name, "prefill", unit, measured, pool=MAIN_POOL)
        for name, unit, measured in towers
        if measured
    )


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
