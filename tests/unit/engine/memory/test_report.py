"""The memory report's grouping on the CPU: what a pipeline's objects hold, and a fake allocator snapshot
grouped by it."""

from __future__ import annotations

import torch

from omnistage.engine.graphs import GraphSet
from omnistage.engine.memory.plan import MiB
from omnistage.engine.memory.report import Holding, group_snapshot, holdings, reachable

PACKAGES = ("omnistage", __name__.split(".")[0])


class Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kv_caches = [torch.zeros(2, 4, 8) for _ in range(2)]  # 256 bytes each
        self.graphs = GraphSet(lambda x: x, None, "cpu")
        self.graphs.pool = (1, 7)
        self.graphs.graph_bytes = {1: 3 * MiB, 2: 5 * MiB}


class Pipeline:
    def __init__(self) -> None:
        self.talker = torch.nn.Linear(4, 4, bias=False)  # 64 bytes
        self.thinker = Runner(torch.nn.Linear(8, 8))  # 256 + 32 bytes
        self.thinker.model.register_buffer("table", torch.zeros(16))  # 64 bytes
        self.talker_stage = Runner(self.talker)  # the same module: counted once, as `talker`
        self.tts = [torch.zeros(10), self.talker.weight[:2]]  # 40 bytes; a view of a weight counts nothing


def test_holdings_group_what_the_objects_hold():
    held = {(h.group, h.owner): h for h in holdings(Pipeline(), PACKAGES)}
    assert {key: h.accounted for key, h in held.items() if h.pool is None} == {
        ("weights", "talker"): 64,
        ("weights", "thinker.model"): 256 + 32,
        ("module buffers", "thinker.model"): 64,
        ("KV", "thinker"): 512,
        ("KV", "talker_stage"): 512,
        ("buffers", "tts"): 40,
    }
    pool = held[("graph pool", "thinker.graphs")]
    assert pool.pool == (1, 7) and pool.accounted == 8 * MiB and pool.device is None
    assert all(h.device is None for h in held.values())
    # off the project's packages nothing is walked into
    assert [path for path, _ in reachable(Pipeline())] == [""]


def block(address: int, size: int, state: str = "active_allocated") -> dict:
    return {"address": address, "size": size, "state": state}


def segment(address: int, blocks: list[dict], pool: tuple[int, int] = (0, 0), device: int = 0) -> dict:
    total = sum(b["size"] for b in blocks)
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "segment_pool_id": pool,
        "blocks": blocks,
    }


def test_a_snapshot_is_grouped_by_what_holds_it():
    weights = Holding("weights", "thinker.model", 0, [(1000, 600), (1600, 400)], accounted=1000)
    kv = Holding("KV", "thinker.runner", 0, [(4000, 2048)], accounted=2048)
    # a static output that lives in the graph pool is the pool's, not its holder's
    outputs = Holding("buffers", "thinker.runner.graphs", 0, [(9000, 100), (5000, 64)], accounted=164)
    graphs = Holding("graph pool", "thinker.runner.graphs", 0, pool=(1, 7), accounted=900)
    # another stage's graphs captured into the same pool: one row for the pool, naming both
    talker_graphs = Holding("graph pool", "talker_stage.graphs", 0, pool=(1, 7), accounted=100)
    elsewhere = Holding("weights", "talker", 1, [(1000, 64)], accounted=64)
    segments = [
        segment(1000, [block(1000, 600), block(1600, 512), block(2112, 888, "inactive")]),
        segment(4000, [block(4000, 2048), block(6048, 1000)]),  # the last: a temporary nobody holds
        segment(9000, [block(9000, 512), block(9512, 512, "inactive")], pool=(1, 7)),
        segment(20000, [block(20000, 256)], pool=(3, 1)),  # a pool no GraphSet names
        segment(5000, [block(5000, 512)]),
        segment(1000, [block(1000, 512)], device=1),
    ]
    held = [weights, kv, outputs, graphs, talker_graphs, elsewhere]
    report, other = group_snapshot(segments, held, {0: (100, 10_000)})
    assert report.device == 0 and other.device == 1
    rows = {(r.group, r.owner): (r.held, r.accounted) for r in report.rows}
    assert rows == {
        ("weights", "thinker.model"): (1112, 1000),
        ("KV", "thinker.runner"): (2048, 2048),
        ("buffers", "thinker.runner.graphs"): (512, 64),
        ("graph pool", "thinker.runner.graphs, talker_stage.graphs"): (1024, 1000),
    }
    assert [r.group for r in report.rows] == ["weights", "KV", "buffers", "graph pool"]
    assert (report.reserved, report.allocated) == (
        2000 + 3048 + 1024 + 256 + 512,
        1112 + 3048 + 512 + 256 + 512,
    )
    assert (report.unaccounted, report.cached, report.other_pools) == (1000, 888, 256)
    held = sum(r.held for r in report.rows)
    assert held + report.unaccounted + report.cached + report.other_pools == report.reserved
    assert {(r.group, r.owner): r.held for r in other.rows} == {("weights", "talker"): 512}
    table = report.table()
    assert table.startswith("memory report of cuda:0: allocator 0.0 MiB reserved")
    assert "outside the allocator (CUDA context, libraries, other processes)" in table
    for name in ("thinker.model", "graph pool", "not accounted", "allocator cache", "other graph pools"):
        assert name in table
    # the shared pool's owners on their own line, its bytes aligned on the next
    lines = table.splitlines()
    at = lines.index("  graph pool      thinker.runner.graphs, talker_stage.graphs")
    assert lines[at + 1].startswith(" " * 58) and lines[at + 1].split() == ["0.0", "MiB", "0.0", "MiB"]
    assert "outside the allocator" not in other.table()
