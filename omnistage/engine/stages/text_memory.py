"""What a text stage needs of its device's memory plan, measured at start on a GPU: its floor (its largest text
prefill step and its encoders on their largest inputs), its graphs' costs, its weights and its KV pool. The
runner and the encoders measure (`profile_peak`, `graph_costs`), the runner warms up; the pipeline plans the
device with every stage's needs (`pipeline/planning.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from omnistage.config import DecoderSettings, EncodersSettings, Graphs
from omnistage.engine.attention import gather_bytes
from omnistage.engine.buckets import decode_buckets, prefill_buckets
from omnistage.engine.memory.measure import graph_candidates, module_bytes, scaled_peaks
from omnistage.engine.memory.plan import (
    MAIN_POOL,
    GiB,
    GraphCandidates,
    KVPool,
    StageMemory,
    least_pages,
)
from omnistage.engine.stages.decoder import torch_module
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.token_runner import TokenRunner

if TYPE_CHECKING:
    from omnistage.engine.stages.text_setup import TextSettings

log = logging.getLogger(__name__)


def text_stage_memory(
    runner: TokenRunner,
    encoders: EncoderStage,
    settings: TextSettings,
    kv_bytes_per_page: int,
    max_prompt_tokens: int,
    max_media: tuple[int, int],
    stage: str = "Thinker",
) -> StageMemory:
    """Measure the floor (the stage's text prefill step and its encoders on their largest inputs, `max_media` =
    most audios and images per prompt), price the graphs and warm up. The stage's KV pool is fixed by the config
    or holds at least one request of the longest length. A runner not in bfloat16 gets no graphs (the
    GPU MoE kernels need it)."""
    engine, budget = settings.engine, settings.stage.max_num_batched_tokens
    cfg = runner.cfg
    gather = gather_bytes(torch_module(runner.model), cfg.num_key_value_heads, cfg.head_dim, runner.dtype)
    floor = encoders.profile_floor(
        runner.profile_peak(budget, 1).bytes + gather,
        budget,
        max_prompt_tokens,
        *max_media,
        rows_held=settings.encoders.rows_bytes,
    )
    graphs: tuple[GraphCandidates, ...] = ()
    if not engine.enforce_eager and runner.dtype != torch.bfloat16:
        log.warning("CUDA graphs need bfloat16 (the GPU MoE kernels); %s steps run eagerly", runner.dtype)
    elif not engine.enforce_eager:
        graphs = _graph_candidates(runner, settings.stage, stage)
        graphs += _encoder_candidates(encoders, settings.encoders)
    runner.warm_up(budget)
    kv = settings.stage.kv
    fixed = kv.pages
    if fixed is None and kv.gib is not None:
        fixed = int(kv.gib * GiB) // kv_bytes_per_page
    resident = [
        (stage, module_bytes(torch_module(runner.model)), "weights"),
        ("audio encoder", module_bytes(encoders.audio_encoder), "weights"),
    ]
    if encoders.vision_encoder is not None:
        resident.append(("vision encoder", module_bytes(encoders.vision_encoder), "weights"))
    return StageMemory(
        resident=tuple(resident),
        peaks=tuple(floor.phases()),
        kv=(
            KVPool(
                stage,
                kv_bytes_per_page,
                min_pages=-(-(max_prompt_tokens + 1) // engine.page_size),
                pages=fixed,
                least_pages=(
                    least_pages(max_prompt_tokens + 1, engine.page_size)
                    if engine.max_model_len is None
                    else None
                ),
            ),
        ),
        graphs=graphs,
    )


def _graph_candidates(
    runner: TokenRunner, thinker: DecoderSettings, stage: str
) -> tuple[GraphCandidates, ...]:
    """The stage's decode and prefill graphs as the config's stages section sizes them (none when eager)."""
    # a graph keeps its outputs (hidden states, logits) in its pool and shares the rest (scratch) with the
    # pool's other graphs; the largest step's measured peak, scaled by batch
    graphs = []
    if buckets := thinker.graphs.sizes(decode_buckets):
        peaks = scaled_peaks(runner.profile_peak(max(buckets), max(buckets)), buckets)
        graphs.append(graph_candidates(stage, "decode", "batch", peaks, pool=stage))
    if prefill := thinker.prefill_graphs.sizes(prefill_buckets):
        # the largest holds as many sequences as it may (`graphs.prefill.StaticPrefillBuffers`): a burst of prompts
        peaks = scaled_peaks(runner.profile_peak(max(prefill), min(max(prefill), thinker.max_batch)), prefill)
        graphs.append(graph_candidates(stage, "prefill", "tokens", peaks, pool=MAIN_POOL))
    return tuple(graphs)


def _encoder_candidates(encoders: EncoderStage, stage: EncodersSettings) -> tuple[GraphCandidates, ...]:
    """The towers' graphs (audio per bucket of windows, vision per bucket of patches): the configured buckets,
    else the encoders' defaults. Prefill-kind: a request pays for them once, not per token. They are captured
    into the device's main-stream pool (`MAIN_POOL`), with the text stage's prefill graphs."""
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
