"""The code predictor as a stage: for each speaking request's new frame, the codes after the first and the
frame's embedding sum, a batch of frames per call through `FrameGraphs`. It keeps no state between calls
(the frame's short KV lives in the set's buffers), so what it brings to its device's plan is its weights and
its graphs' measured prices."""

from __future__ import annotations

from typing import Any

from torch import nn

from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.graphs.frames import FrameGraphs
from omnistage.engine.memory.measure import graph_candidates, module_bytes
from omnistage.engine.memory.plan import MAIN_POOL, MemoryPlan, StageMemory
from omnistage.engine.stages.base import OverGraphs


class FrameStage(OverGraphs):
    graphs: FrameGraphs
    name = "code predictor"

    def __init__(self, model: nn.Module, graphs: FrameGraphs, graph_sizes: list[int]) -> None:
        """`model`: the predictor whose weights `graphs` runs; `graph_sizes`: the batch buckets the plan may
        grant (the stage's graph settings)."""
        self.model, self.graphs, self.graph_sizes = model, graphs, graph_sizes

    def memory(self) -> StageMemory:
        """Its weights, and its graphs priced over its own buffers (none off CUDA or eager)."""
        costs = self.graphs.graph_costs(self.graph_sizes)
        graphs = graph_candidates(self.name, "decode", "frames", costs, MAIN_POOL)
        return StageMemory(
            resident=((self.name, module_bytes(self.model), "weights"),),
            graphs=(graphs,) if graphs.costs else (),
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """The graphs of the batch buckets `plan` grants, into `pool` (or a new one)."""
        self.graphs.capture(int_buckets(plan.captured(self.name, "decode")), pool=pool)
