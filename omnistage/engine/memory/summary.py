"""The start-up prose of a text stage (stages/text.py): what it loaded, the KV pool it was given and the CUDA
graphs it captured, in one line; the plan's own table and gauges are plan.py's and gauges.py's, where memory
went after start report.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnistage.engine.memory.measure import module_bytes
from omnistage.engine.memory.plan import GiB
from omnistage.engine.stages.decoder import torch_module

if TYPE_CHECKING:
    from omnistage.engine.stages.text import TextStage


def text_stage_summary(stage: TextStage) -> str:
    """A text stage's start-up line: its model and weights, its KV pool and context, and the CUDA graphs it
    captured (its own and its encoders') or the steps it runs eagerly."""
    kv_gib = stage.pool.num_pages * stage.kv_bytes_per_page / GiB
    weights_gib = module_bytes(torch_module(stage.model)) / GiB
    graphs = ""
    if stage.device.type == "cuda" and stage.settings.engine.enforce_eager:
        graphs = "; no CUDA graphs (enforce_eager): every step runs eagerly"
    elif stage.device.type == "cuda":
        decode = stage.runner.graphs.captured_buckets if stage.runner.graphs else []
        prefill = stage.runner.prefill_graphs.captured_buckets if stage.runner.prefill_graphs else []
        planned = stage.plan.graph_set(stage.name, "decode") if stage.plan else None
        eager = planned.eager if planned else ()
        graphs = (
            f"; decode CUDA graphs for batch {', '.join(map(str, decode))} "
            f"(eager: larger batches{', ' + ', '.join(map(str, eager)) if eager else ''})"
            f"{stage.runner.graphs.routes_note()}"
            if decode and stage.runner.graphs is not None
            else "; decode steps run eagerly"
        )
        graphs += (
            f"; prefill CUDA graphs for steps of {prefill[0]}..{prefill[-1]} tokens of up to "
            f"{stage.runner.prefill_graphs.buffers.max_seqs} sequences ({len(prefill)} buckets; longer steps "
            "and images' run eagerly)"
            if prefill and stage.runner.prefill_graphs is not None
            else "; prefill steps run eagerly"
        )
        towers = stage.encoders.captured
        for tower, unit in (("audio", "windows"), ("vision", "patches")):
            if towers[tower]:
                graphs += f"; {tower} encoder CUDA graphs for {unit} {', '.join(map(str, towers[tower]))}"
        if decode or prefill or any(towers.values()):
            graphs += f"; graphs captured in {stage.capture_seconds:.1f} s"
    return (
        f"model {stage.model_path} on {stage.device} ({str(stage.dtype).removeprefix('torch.')}), "
        f"weights {weights_gib:.2f} GiB loaded in {stage.load_seconds:.1f} s; "
        f"KV pool {stage.pool.num_pages:,} pages x {stage.page_size} tokens = {kv_gib:.2f} GiB "
        f"({stage.pool.num_pages * stage.page_size:,} tokens); max model length {stage.max_model_len:,}{graphs}"
    )
