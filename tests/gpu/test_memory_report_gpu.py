"""The memory report of a started pipeline on a GPU: the allocator's snapshot grouped by what holds it adds up,
and the weights, KV pages and graph pools it finds are what the stages account for.

One started pipeline serves both tests: `omnistage memory-report` is handed it instead of starting its own.
"""

import pytest
import torch

from omnistage.config import engine_config
from omnistage.engine.memory.report import group_snapshot, holdings
from omnistage.pipeline.family import build_pipeline

pytestmark = pytest.mark.gpu


# uncompiled: the report reads the allocator, which the compiled layers do not change, and the compile's
# builds took this file past its ~90 s
SETTINGS = dict(device="cuda", dtype="bfloat16", page_size=4, kv_cache_memory_gib=0.05, compile=False)


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return build_pipeline(engine_config(model=str(tiny_checkpoint), **SETTINGS))


def test_the_snapshot_of_a_started_pipeline_is_grouped(pipeline):
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    held_by = {(h.group, h.owner): h for h in holdings(pipeline)}
    reports = group_snapshot(torch.cuda.memory_snapshot(), list(held_by.values()))
    (report,) = [r for r in reports if r.device == device]
    held = sum(r.held for r in report.rows)
    assert held + report.unaccounted + report.cached + report.other_pools == report.reserved
    assert report.reserved == torch.cuda.memory_reserved(device)
    assert abs(report.allocated - torch.cuda.memory_allocated(device)) <= 1 << 20
    rows = {(r.group, r.owner): r for r in report.rows}
    for key in (("weights", "thinker.model"), ("KV", "thinker.runner")):
        row, tensors = rows[key], len(held_by[key].spans)
        assert row.accounted <= row.held <= row.accounted + tensors * (2 << 20)  # a block rounds a tensor up
    assert rows[("graph pool", "thinker.runner.graphs")].held > 0  # the decode graphs' own pool
    # the main-stream pool: the prefill graphs and every other set replayed on the main stream, one row
    (main,) = [r for r in report.rows if r.group == "graph pool" and "prefill_graphs" in r.owner]
    assert main.held > 0 and "talker_stage.runner.graphs" in main.owner


def test_memory_report_prints_it(tiny_checkpoint, pipeline, capsys, monkeypatch):
    """`omnistage memory-report` parses its flags into the pipeline's configuration; what it then builds is
    that pipeline, whose report it prints."""
    import omnistage.pipeline.family
    from omnistage.cli import main

    built = []

    def build(config):
        built.append(config)
        return pipeline

    monkeypatch.setattr(omnistage.pipeline.family, "build_pipeline", build)
    argv = ["memory-report", "--model", str(tiny_checkpoint), "--device", "cuda", "--dtype", "bfloat16",
            "--page-size", "4", "--kv-cache-memory-gib", "0.05", "--no-compile"]  # fmt: skip
    assert main(argv) == 0
    assert built == [engine_config(model=str(tiny_checkpoint), **SETTINGS)]
    device = torch.cuda.current_device()
    printed = capsys.readouterr().out
    assert f"memory report of cuda:{device}: allocator" in printed and "memory plan" in printed
    assert "thinker.model" in printed and "not accounted" in printed
