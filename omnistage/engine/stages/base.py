"""The one shape every stage has for its pipeline (ARCHITECTURE.md, "Stages").

A pipeline loads its stages, asks each on a GPU what it needs of its device (`memory`, measured there), plans
every device once for all its stages (pipeline/planning.py), then hands each stage the plan to take its share
of (`allocate`: its KV pages first, then its graphs, which record the pages' addresses). Stages that run one
after another on a device's main stream capture into one graph memory pool: the first makes it, the later
ones join it (`graph_pool`). The text stage (text.py) and the row stage (rows.py) implement it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from omnistage.engine.graphs.base import GraphSet
from omnistage.engine.memory.plan import MemoryPlan, StageMemory


@runtime_checkable
class Stage(Protocol):
    @property
    def name(self) -> str:
        """The stage's name in its device's memory plan ("Thinker", "Talker")."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def graph_pool(self) -> Any:
        """The graph memory pool its graphs were captured into, once allocated (None before)."""
        ...

    def memory(self) -> StageMemory:
        """What it needs of its device's plan: its weights, its eager floor, its KV pool and its graph
        candidates with their measured prices (it warms up on the way)."""
        ...

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """Its KV pages, then its graphs, as `plan` grants them; the graphs into `pool` (the device's
        main-stream pool where another stage made it) or a new one."""
        ...

    def stats(self) -> dict[str, int]:
        """Its counters: requests waiting and running, KV pages, and the device allocator's on a GPU."""
        ...


class OverGraphs:
    """What a stage whose every step is a call of one graph set (`graphs`: the code predictor's, Code2Wav's)
    reports of itself: its device, its graphs' pool and what it captured."""

    graphs: GraphSet[Any]

    @property
    def device(self) -> torch.device:
        return self.graphs.device

    @property
    def graph_pool(self) -> Any:
        return self.graphs.pool

    def stats(self) -> dict[str, int]:
        return {"graphs_captured": len(self.graphs.captured_buckets)}
