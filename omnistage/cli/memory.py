"""`omnistage plan` and `omnistage memory-report`: load a checkpoint as serve would and print its memory."""

from __future__ import annotations

import argparse

from omnistage.cli.engine_flags import engine_config_of


def plan(args: argparse.Namespace) -> None:
    """Load the checkpoint as serve would, print what it planned for each device and captured, and exit."""
    from omnistage.pipeline.family import build_pipeline

    pipeline = build_pipeline(engine_config_of(args))
    _print_plans(pipeline)
    print(pipeline.memory_summary())


def _print_plans(pipeline: object) -> None:
    from omnistage.engine.memory.plan import MemoryPlan
    from omnistage.engine.memory.report import reachable

    plans = [obj for _, obj in reachable(pipeline) if isinstance(obj, MemoryPlan)]
    for device_plan in plans:
        print(device_plan.table())
    if not plans:
        print("no GPU plan: the engine runs on the CPU")


def report(args: argparse.Namespace) -> None:
    """Load the checkpoint as serve would, and print where each device's memory went, grouped by what holds it."""
    import torch

    from omnistage.engine.memory.report import accounting_table, group_snapshot, holdings
    from omnistage.pipeline.family import build_pipeline

    pipeline = build_pipeline(engine_config_of(args))
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
