"""One memory plan per device: every stage placed on a GPU says what it needs (`StageMemory`: weights, the
peaks of its largest steps, its KV pool, its graph candidates with their prices), each device is read once its
stages are loaded and measured and planned once for all of them (`memory.planner.plan_device`), and each stage
then takes its grant (`allocate`). No stage plans a device for another.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from omnistage.engine.memory.measure import read_device
from omnistage.engine.memory.plan import MemoryPlan, StageMemory
from omnistage.engine.memory.planner import plan_device

log = logging.getLogger(__name__)


def plan_devices(
    needs: Iterable[tuple[torch.device, StageMemory]], limit_gib: float | None
) -> dict[torch.device, MemoryPlan]:
    """The plan of each device named in `needs` (a stage's device and what it needs), under `limit_gib`
    (gpu_memory_limit) each; every plan's table goes to the log."""
    by_device: dict[torch.device, list[StageMemory]] = {}
    for device, need in needs:
        by_device.setdefault(device, []).append(need)
    plans = {}
    for device, stages in by_device.items():
        plans[device] = plan = plan_device(read_device(device, limit_gib), stages)
        log.info("%s", plan.table())
    return plans
