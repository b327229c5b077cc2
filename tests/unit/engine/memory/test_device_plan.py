"""plan_device over fake measured costs: every stage on a device in one plan (its floor, its graphs cheapest
first across the stages, each bucket whole or not at all, its KV pools), and the two-GPU topology as two
plans made independently."""

from __future__ import annotations

import pytest

from omnistage.engine.memory.gauges import Gauge, plan_gauges
from omnistage.engine.memory.plan import (
    DeviceMemory,
    GiB,
    GraphCandidates,
    KVPool,
    MiB,
    StageMemory,
)
from omnistage.engine.memory.planner import plan_device
from omnistage.errors import ConfigError

THINKER_PAGE, TALKER_PAGE = 12 * MiB, 2 * MiB


def thinker(min_pages: int = 512) -> StageMemory:
    """The Thinker with its encoders, as on GPU 0 of the two-GPU topology."""
    return StageMemory(
        resident=(("Thinker", 59 * GiB, "weights"), ("audio encoder", GiB, "weights")),
        peaks=(("text prefill", GiB, "2,048 tokens"), ("vision encoder", 3 * GiB, "3584x3584 image")),
        kv=(KVPool("Thinker", THINKER_PAGE, min_pages),),
        graphs=(
            GraphCandidates("Thinker", "decode", "batch", {1: 40 * MiB, 2: 40 * MiB, 64: 200 * MiB}),
            GraphCandidates("Thinker", "prefill", "tokens", {16: 10 * MiB, 512: 300 * MiB}),
            GraphCandidates("vision encoder", "prefill", "patches", {1024: 30 * MiB, 8192: 250 * MiB}),
        ),
    )


def speech(share: float | None = None, min_pages: int = 64) -> StageMemory:
    """The Talker, code predictor and Code2Wav, as on GPU 1 (the Talker's pool takes the rest there) or
    beside the Thinker (a share)."""
    return StageMemory(
        resident=(("Talker", 6 * GiB, "weights"), ("Code2Wav", GiB // 2, "weights")),
        peaks=(("Talker prefill", GiB // 2, "2,048 rows"), ("Code2Wav", 2 * GiB, "16 streams × 325 frames")),
        kv=(KVPool("Talker", TALKER_PAGE, min_pages, share=share),),
        graphs=(
            GraphCandidates("Talker", "decode", "batch", {1: 20 * MiB, 8: 30 * MiB}),
            GraphCandidates("code predictor", "decode", "frames", {1: 5 * MiB, 16: 60 * MiB}),
            GraphCandidates(
                "Code2Wav", "decode", "chunk x streams", {(25, 1): 15 * MiB, (25, 16): 400 * MiB}
            ),
        ),
    )


def device(allocated: int, name: str, free: int = 80 * GiB) -> DeviceMemory:
    return DeviceMemory(total=80 * GiB, free=free, allocated=allocated, limit=80 * GiB, name=name)


def test_decode_graphs_of_every_stage_go_first_cheapest_first_each_bucket_whole():
    plan = plan_device(device(67 * GiB, "cuda:0"), [thinker(), speech(share=0.2)], graph_budget=200 * MiB)
    # decode kind, cheapest first across stages: predictor 1 (5), Code2Wav 25x1 (15), Talker 1 (20),
    # Talker 8 (30), Thinker 1 (40), Thinker 2 (40) = 150 MiB; the predictor's 16 (60) does not fit whole,
    # and nothing dearer is tried. The 50 MiB left go to the cheapest prefill kind: 16 tokens, 1024 patches.
    assert plan.captured("code predictor", "decode") == (1,)
    assert plan.captured("Code2Wav", "decode") == ((25, 1),)
    assert plan.captured("Talker", "decode") == (1, 8)
    assert plan.captured("Thinker", "decode") == (1, 2) and plan.graph_set("Thinker", "decode").eager == (64,)
    assert plan.captured("Thinker", "prefill") == (16,)
    assert plan.captured("vision encoder", "prefill") == (1024,)
    assert plan.graph_set("Code2Wav", "decode").eager == ((25, 16),)
    assert plan.graph_bytes == 190 * MiB
    assert (
        plan.captured("audio encoder", "prefill") == () and plan.graph_set("audio encoder", "prefill") is None
    )


def test_a_budget_for_every_graph_captures_every_graph():
    plan = plan_device(device(67 * GiB, "cuda:0"), [thinker(), speech(share=0.2)], graph_budget=4 * GiB)
    assert all(g.eager == () for g in plan.graphs) and len(plan.graphs) == 6
    assert plan.graph_bytes == sum(sum(g.candidates.costs.values()) for g in plan.graphs)


def test_the_largest_phase_of_any_stage_sets_the_floor():
    alone = plan_device(device(60 * GiB, "cuda:0"), [thinker()])
    shared = plan_device(device(67 * GiB, "cuda:0"), [thinker(), speech(share=0.2)])
    assert alone.floor == 3 * GiB  # the vision encoder's
    assert shared.floor == 3 * GiB  # Code2Wav's 2 GiB is below it
    louder = StageMemory(peaks=(("Code2Wav", 5 * GiB, "64 streams"),))
    assert plan_device(device(67 * GiB, "cuda:0"), [thinker(), louder]).floor == 5 * GiB
    names = [name for name, _, _ in shared.phases]
    assert names == ["text prefill", "vision encoder", "Talker prefill", "Code2Wav"]


def test_kv_pools_share_what_the_graphs_leave():
    plan = plan_device(device(67 * GiB, "cuda:0"), [thinker(), speech(share=0.25)], graph_budget=0)
    extra = plan.device.available - plan.floor - plan.reserve - 512 * THINKER_PAGE - 64 * TALKER_PAGE
    talker, thinker_kv = plan.kv_pool("Talker"), plan.kv_pool("Thinker")
    assert talker.pages == 64 + int(0.25 * extra) // TALKER_PAGE
    assert thinker_kv.pages == 512 + (extra - (talker.pages - 64) * TALKER_PAGE) // THINKER_PAGE
    assert 0 <= plan.free < THINKER_PAGE
    assert plan.weights + plan.floor + plan.reserve + plan.graph_bytes + plan.kv_bytes + plan.free == 80 * GiB


def test_two_devices_are_planned_independently():
    gpu0 = plan_device(device(60 * GiB, "cuda:0"), [thinker()])
    gpu1 = plan_device(device(6 * GiB + GiB // 2, "cuda:1"), [speech()])
    # each device's pool takes what is left there; one's stages change nothing of the other's plan
    assert gpu0 == plan_device(device(60 * GiB, "cuda:0"), [thinker()])
    assert gpu0.floor == 3 * GiB and gpu1.floor == 2 * GiB
    assert [kv.pool.stage for kv in gpu0.kv] == ["Thinker"] and [kv.pool.stage for kv in gpu1.kv] == [
        "Talker"
    ]
    for plan in (gpu0, gpu1):
        assert (
            plan.weights + plan.floor + plan.reserve + plan.graph_bytes + plan.kv_bytes + plan.free
            == 80 * GiB
        )
    assert {g.candidates.stage for g in gpu1.graphs} == {"Talker", "code predictor", "Code2Wav"}
    assert gpu1.kv_pool("Talker").bytes > 60 * GiB  # the speech GPU's memory is the Talker's pages
    with pytest.raises(KeyError, match="no KV pool of 'Talker' in the plan of cuda:0"):
        gpu0.kv_pool("Talker")


def test_one_request_that_does_not_fit_names_the_stage_and_the_phase():
    # GPU 1 with 10 GiB: 6.5 GiB weights + 2 GiB Code2Wav + 0.5 GiB reserve + 1.5 GiB of one Talker request
    small = device(6 * GiB + GiB // 2, "cuda:1", free=3 * GiB + GiB // 2)
    with pytest.raises(ConfigError) as exc:
        plan_device(small, [speech(min_pages=768)])
    assert str(exc.value) == (
        "the stages on cuda:1 do not fit in gpu_memory_limit 80.00 GiB: weights 6.50 GiB + floor 2.00 GiB "
        "(the Code2Wav) + reserve 0.50 GiB + Talker KV 1.50 GiB (768 pages for one request) = 10.50 GiB, but "
        "only 10.00 GiB is available (3.50 GiB free after loading)"
    )
    assert plan_device(small, [speech(min_pages=512)]).kv_pool("Talker").pages >= 512


def test_the_table_lists_every_stage_of_the_device():
    plan = plan_device(device(68 * GiB, "cuda:0"), [thinker(), speech(share=0.2)], graph_budget=200 * MiB)
    table = plan.table()
    for line in (
        "memory plan (gpu_memory_limit: 80.00 GiB) on cuda:0",
        "  weights                      68.00 GiB",
        "    Thinker                    59.00 GiB  weights",
        "    Talker                      6.00 GiB  weights",
        "    other allocations           1.50 GiB  buffers and tables the stages do not list",
        "    Talker                      ",  # the Talker's KV row
        "  CUDA graphs                   0.19 GiB  8/13 buckets",
        "    Thinker decode              0.08 GiB  2/3 batch 1..2",
        "    vision encoder prefill      0.03 GiB  1/2 patches 1024..1024",
        "    Code2Wav decode             0.01 GiB  1/2 chunk x streams 25x1..25x1",
        "  floor (eager peak)            3.00 GiB  the largest of:",
        "    Code2Wav                    2.00 GiB  16 streams × 325 frames",
        "  reserve                       0.50 GiB",
        "  eager Thinker decode (batch): 64",
        "  eager Code2Wav decode (chunk x streams): 25x16",
    ):
        assert line in table, table
    assert ", share 20%" in table and "pages × 12.00 MiB" in table and "pages × 2.00 MiB" in table
    assert all(len(line) <= 100 for line in table.splitlines())


def test_gauges_carry_the_plan_per_device_stage_and_set():
    plan = plan_device(device(67 * GiB, "cuda:1"), [thinker(), speech(share=0.2)], graph_budget=200 * MiB)
    gauges = plan_gauges(plan)
    assert all(isinstance(g, Gauge) and g.labels["device"] == "cuda:1" for g in gauges)
    values = {(g.name, tuple(sorted(g.labels.items()))): g.value for g in gauges}

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted({"device": "cuda:1", **labels}.items())))]

    assert value("omnistage_memory_plan_bytes", part="weights", stage="Talker") == 6 * GiB
    assert value("omnistage_memory_plan_bytes", part="kv", stage="Talker") == plan.kv_pool("Talker").bytes
    assert value("omnistage_memory_plan_bytes", part="floor", stage="") == 3 * GiB
    assert (
        value("omnistage_memory_plan_bytes", part="graphs", stage="Thinker") == 90 * MiB
    )  # decode + prefill
    assert value("omnistage_memory_plan_kv_pages", stage="Thinker") == plan.kv_pool("Thinker").pages
    assert value("omnistage_memory_plan_graphs", stage="Code2Wav", kind="decode", state="eager") == 1
    assert value("omnistage_memory_plan_graphs", stage="Thinker", kind="decode", state="captured") == 2
    assert value("omnistage_memory_plan_graph_bytes", stage="Talker", kind="decode") == 50 * MiB
    assert value("omnistage_memory_plan_floor_phase_bytes", phase="Talker prefill") == GiB // 2
    by_name: dict[str, set] = {}
    for g in gauges:  # one label set per metric name, as Prometheus wants
        by_name.setdefault(g.name, set()).add(tuple(sorted(g.labels)))
    assert all(len(keys) == 1 for keys in by_name.values())


def test_pools_and_sets_that_cannot_be_planned_are_refused():
    rest = StageMemory(kv=(KVPool("Talker", TALKER_PAGE, 64),))
    with pytest.raises(ValueError, match="only one KV pool may take what the shares leave"):
        plan_device(device(60 * GiB, "cuda:0"), [thinker(), rest])
    greedy = StageMemory(
        kv=(KVPool("Talker", TALKER_PAGE, 64, share=0.6), KVPool("Code2Wav", MiB, 1, share=0.6))
    )
    with pytest.raises(ValueError, match="add up to more than 1"):
        plan_device(device(60 * GiB, "cuda:0"), [thinker(), greedy])
    twice = StageMemory(graphs=(GraphCandidates("Thinker", "decode", "batch", {4: MiB}),))
    with pytest.raises(ValueError, match="one graph set per stage and kind"):
        plan_device(device(60 * GiB, "cuda:0"), [thinker(), twice])
    with pytest.raises(ValueError, match="graph kind must be one of"):
        GraphCandidates("Talker", "encode", "batch", {1: MiB})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a share or fixed pages, not both"):
        KVPool("Talker", TALKER_PAGE, 64, share=0.5, pages=10)


def encoders(pool: str, kept: bool = True) -> StageMemory:
    """Two towers whose graphs keep little of their peak (their rows), the rest being scratch."""
    audio = {8: 300 * MiB, 32: 1200 * MiB}
    vision = {1024: 200 * MiB, 8192: 1600 * MiB}
    return StageMemory(
        resident=(("towers", 2 * GiB, "weights"),),
        peaks=(("vision encoder", GiB, "image"),),
        kv=(KVPool("Thinker", THINKER_PAGE, 16),),
        graphs=(
            GraphCandidates("audio encoder", "prefill", "windows", audio, pool=pool,
                            kept={8: 4 * MiB, 32: 16 * MiB} if kept else None),
            GraphCandidates("vision encoder", "prefill", "patches", vision, pool="thinker",
                            kept={1024: 8 * MiB, 8192: 64 * MiB} if kept else None),
        ),
    )  # fmt: skip


def test_graphs_of_one_pool_pay_what_they_keep_and_the_largest_scratch_once():
    budget = 1700 * MiB  # under the 3,300 MiB of the four peaks, over 92 MiB kept + 1,536 MiB of scratch
    shared = plan_device(device(67 * GiB, "cuda:0"), [encoders("thinker")], graph_budget=budget)
    assert shared.captured("audio encoder", "prefill") == (8, 32)
    assert shared.captured("vision encoder", "prefill") == (1024, 8192)
    # cheapest first: vision 1024 (200), audio 8 (4 + 104 more scratch), audio 32 (16 + 888), vision 8192
    # (64 + 352): 1,628 MiB, every graph's rows and the largest scratch (1,536) once
    assert sum(g.bytes for g in shared.graphs) == (4 + 16 + 8 + 64) * MiB + 1536 * MiB
    # apart, each pool needs its own scratch: the largest vision graph no longer fits
    apart = plan_device(device(67 * GiB, "cuda:0"), [encoders("audio")], graph_budget=budget)
    assert apart.captured("audio encoder", "prefill") == (8, 32)
    assert apart.captured("vision encoder", "prefill") == (1024,)
    assert sum(g.bytes for g in apart.graphs) <= budget
    # without kept bytes a graph is priced at its whole peak, as before
    whole = plan_device(device(67 * GiB, "cuda:0"), [encoders("thinker", kept=False)], graph_budget=budget)
    assert sum(g.bytes for g in whole.graphs) == 300 * MiB + 200 * MiB + 1200 * MiB


def test_kept_bytes_are_per_bucket_and_within_its_cost():
    with pytest.raises(ValueError, match="kept bytes"):
        GraphCandidates("Code2Wav", "decode", "streams", {1: 10, 2: 20}, kept={1: 11, 2: 0})
    with pytest.raises(ValueError, match="kept bytes"):
        GraphCandidates("Code2Wav", "decode", "streams", {1: 10, 2: 20}, kept={1: 1})
