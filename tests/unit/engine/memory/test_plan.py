from dataclasses import replace

import pytest

from omnistage.engine.buckets import bucket_for, decode_buckets
from omnistage.engine.memory.floor import Floor
from omnistage.engine.memory.plan import (
    DEFAULT_RESERVE,
    DeviceMemory,
    GiB,
    GraphCandidates,
    KVPool,
    MiB,
    StageMemory,
    kv_bytes_per_page,
)
from omnistage.engine.memory.planner import plan_device
from omnistage.errors import ConfigError


def plan_memory(
    total: int,
    free_after_weights: int,
    weights: int,
    floor_peak: int | Floor,
    kv_bytes_per_page: int,
    graph_cost_per_bucket: dict[int, int],
    limit: int | None = None,
    reserve: int = DEFAULT_RESERVE,
    graph_budget: int | None = None,
    min_kv_pages: int = 1,
    prefill_graph_costs: dict[int, int] | None = None,
):
    """The Thinker alone on a device: its decode and prefill graphs, its KV pool taking the rest."""
    phases = floor_peak.phases() if isinstance(floor_peak, Floor) else [("text prefill", floor_peak, "")]
    graphs = [GraphCandidates("Thinker", "decode", "batch", graph_cost_per_bucket)]
    if prefill_graph_costs:
        graphs.append(GraphCandidates("Thinker", "prefill", "tokens", prefill_graph_costs))
    thinker = StageMemory(
        peaks=tuple(phases), kv=(KVPool("Thinker", kv_bytes_per_page, min_kv_pages),), graphs=tuple(graphs)
    )
    device = DeviceMemory(total, free_after_weights, weights, limit, "cuda:0")
    return plan_device(device, [thinker], reserve=reserve, graph_budget=graph_budget)


def test_decode_graphs_claim_the_budget_before_prefill_graphs():
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=12 * GiB,
        weights=66 * GiB,
        floor_peak=2 * GiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket={1: 100 * MiB, 2: 100 * MiB, 4: 200 * MiB},
        prefill_graph_costs={16: 10 * MiB, 32: 20 * MiB, 512: 300 * MiB},
        graph_budget=450 * MiB,
    )
    assert plan.captured("Thinker", "decode") == (1, 2, 4)  # 400 MiB, although prefill 16 is cheaper
    assert plan.captured("Thinker", "prefill") == (16, 32) and plan.graph_set("Thinker", "prefill").eager == (
        512,
    )
    assert plan.graph_bytes == 430 * MiB
    assert plan.floor + plan.reserve + plan.graph_bytes + plan.kv_bytes + plan.free == 12 * GiB
    table = plan.table()
    for line in (
        "  CUDA graphs                   0.42 GiB  5/6 buckets",
        "    Thinker decode              0.39 GiB  3/3 batch 1..4",
        "    Thinker prefill             0.03 GiB  2/3 tokens 16..32",
    ):
        assert f"{line}\n" in table, table
    assert "  eager Thinker prefill (tokens): 512" in table


def test_kv_bytes_per_page_thinker():
    # 48 layers x 4 KV heads x 128 x 2 (K, V) x bf16 = 96 KiB per token; a 128-token page is 12 MiB.
    assert kv_bytes_per_page(48, 4, 128, 128) == 12 * MiB


def test_plan_arithmetic():
    costs = {1: 100 * MiB, 2: 100 * MiB, 4: 110 * MiB, 8: 120 * MiB}
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=12 * GiB,
        weights=66 * GiB,
        floor_peak=2 * GiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket=costs,
        reserve=512 * MiB,
        graph_budget=320 * MiB,
    )
    assert plan.captured("Thinker", "decode") == (1, 2, 4)
    assert plan.graph_set("Thinker", "decode").eager == (8,)
    assert plan.graph_bytes == 310 * MiB
    spare = 12 * GiB - 2 * GiB - 512 * MiB - 310 * MiB
    assert plan.kv_pool("Thinker").pages == spare // (12 * MiB)
    assert plan.kv_bytes == plan.kv_pool("Thinker").pages * 12 * MiB
    assert 0 <= plan.free < 12 * MiB
    assert plan.floor + plan.reserve + plan.graph_bytes + plan.kv_bytes + plan.free == 12 * GiB
    assert bucket_for(3, plan.captured("Thinker", "decode")) == 4
    assert bucket_for(5, plan.captured("Thinker", "decode")) is None


def test_cheapest_first_all_or_nothing():
    # Bucket 1 is the most expensive here; the cheap ones go first, and a bucket that does not fit whole
    # is left out rather than partly captured.
    costs = {1: 300 * MiB, 2: 50 * MiB, 4: 60 * MiB, 8: 200 * MiB}
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=10 * GiB,
        weights=60 * GiB,
        floor_peak=1 * GiB,
        kv_bytes_per_page=MiB,
        graph_cost_per_bucket=costs,
        graph_budget=320 * MiB,
    )
    assert plan.captured("Thinker", "decode") == (2, 4, 8)
    assert plan.graph_set("Thinker", "decode").eager == (1,)
    assert plan.graph_bytes == 310 * MiB
    assert bucket_for(1, plan.captured("Thinker", "decode")) == 2


def test_graphs_claim_what_the_minimums_leave_before_kv_pages_beyond_them():
    costs = {b: 600 * MiB for b in decode_buckets(128)}
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=5 * GiB + 512 * MiB,
        weights=66 * GiB,
        floor_peak=512 * MiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket=costs,
        reserve=0,
        min_kv_pages=100,
    )
    # 5 GiB spare, 1,200 MiB of it the pool's minimum: 6 graphs of 600 MiB (3,600 MiB), smaller buckets first
    # at equal costs; the pool gets its minimum and the 320 MiB left (26 pages)
    assert plan.captured("Thinker", "decode") == (1, 2, 4, 8, 16, 24)
    assert plan.kv_pool("Thinker").pages == 100 + 320 // 12


def test_limit_caps_the_plan():
    kwargs = dict(
        total=141 * GiB,
        free_after_weights=70 * GiB,
        weights=66 * GiB,
        floor_peak=2 * GiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket={1: 64 * MiB},
        reserve=0,
        graph_budget=GiB,
    )
    free = plan_memory(**kwargs)
    capped = plan_memory(**kwargs, limit=80 * GiB)
    assert capped.kv_pool("Thinker").pages < free.kv_pool("Thinker").pages
    used = capped.weights + capped.floor + capped.graph_bytes + capped.kv_bytes + capped.free
    assert used == 80 * GiB
    assert capped.total == 80 * GiB


def test_no_graphs_when_budget_is_zero():
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=4 * GiB,
        weights=66 * GiB,
        floor_peak=GiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket={1: MiB, 2: MiB},
        graph_budget=0,
    )
    assert plan.captured("Thinker", "decode") == ()
    assert plan.graph_set("Thinker", "decode").eager == (1, 2)


def test_error_says_the_numbers():
    with pytest.raises(ConfigError) as exc:
        plan_memory(
            total=80 * GiB,
            free_after_weights=GiB,
            weights=66 * GiB,
            floor_peak=2 * GiB,
            kv_bytes_per_page=12 * MiB,
            graph_cost_per_bucket={},
            reserve=512 * MiB,
        )
    msg = str(exc.value)
    assert msg.startswith("the stages on cuda:0 do not fit in 80.00 GiB: weights 66.00 GiB + floor 2.00 GiB ")
    assert "(the text prefill) + reserve 0.50 GiB + Thinker KV 0.01 GiB (1 page for one request)" in msg
    assert "1.00 GiB free after loading" in msg


def test_error_names_the_limit():
    with pytest.raises(ConfigError, match="gpu_memory_limit 60.00 GiB"):
        plan_memory(
            total=141 * GiB,
            free_after_weights=70 * GiB,
            weights=66 * GiB,
            floor_peak=GiB,
            kv_bytes_per_page=MiB,
            graph_cost_per_bucket={},
            limit=60 * GiB,
        )


def test_table_fits_one_screen():
    plan = plan_memory(
        total=80 * GiB,
        free_after_weights=12 * GiB,
        weights=66 * GiB,
        floor_peak=2 * GiB,
        kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket={1: 100 * MiB, 2: 100 * MiB, 128: 5 * GiB},
        graph_budget=GiB,
    )
    table = plan.table()
    lines = table.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 100 for line in lines)
    for word in ("weights", "KV pages", "CUDA graphs", "floor", "free", "66.00 GiB", "2/3 buckets"):
        assert word in table
    assert f"Thinker: {plan.kv_pool('Thinker').pages:,} pages × 12.00 MiB" in table
    assert "eager Thinker decode (batch): 128" in table


def test_floor_is_the_largest_phase_of_the_largest_requests():
    """An encoder's peak on the largest input it admits, or the largest prefill step, each beside the encoder
    rows held at once (the largest request's), whichever is larger, is the floor; each shows as its own line
    of the table."""
    text = Floor(prefill=GiB, prefill_tokens=2048)
    assert text.peak == GiB
    audio = replace(text, audio_encoder=3 * GiB, audio_outputs=16 * MiB, audio_seconds=300.0)
    assert audio.peak == 3 * GiB  # the encoder's own peak holds its outputs too
    images = replace(audio, vision_encoder=2 * GiB, image_outputs=2560 * MiB, image_size=(3584, 3584))
    assert images.rows_limit == 2560 * MiB
    assert images.peak == 3 * GiB - 16 * MiB + 2560 * MiB  # a clip's call beside an image's rows
    assert (
        replace(images, vision_encoder=9 * GiB, images=3).peak == 9 * GiB + 2 * 2560 * MiB
    )  # the third call

    kwargs = dict(
        total=80 * GiB, free_after_weights=12 * GiB, weights=66 * GiB, kv_bytes_per_page=12 * MiB,
        graph_cost_per_bucket={}, reserve=512 * MiB,
    )  # fmt: skip
    images = replace(images, audio_clips=2, images=2)
    plain, planned = plan_memory(floor_peak=GiB, **kwargs), plan_memory(floor_peak=images, **kwargs)
    assert planned.floor == images.peak == 3 * GiB - 16 * MiB + 5120 * MiB and plain.floor == GiB
    assert (
        0
        <= (plain.kv_pool("Thinker").pages - planned.kv_pool("Thinker").pages) * 12 * MiB
        - (images.peak - GiB)
        < 12 * MiB
    )
    assert planned.floor + planned.reserve + planned.kv_bytes + planned.free == 12 * GiB
    table = planned.table()
    for line in (
        "floor (eager peak)            7.98 GiB  the largest of:",
        "  text prefill                1.00 GiB  2,048 tokens",
        "  audio encoder               7.98 GiB  2 x 300 s clip, one call each, beside 5,120 MiB of rows held",
        "  audio prefill               1.03 GiB  with 2 x 300 s clip: 32 MiB of encoder rows held",
        "  vision encoder              4.50 GiB  2 x 3584x3584 image, one call each",
        "  image prefill               6.00 GiB  with 2 x 3584x3584 image: 5,120 MiB of encoder rows held",
    ):
        assert f"  {line}" in table, table
    assert (
        "with the 300 s clip's 16 MiB of encoder rows held" in plan_memory(floor_peak=audio, **kwargs).table()
    )
    # more rows held at once than one largest request's: beside every tower call and prefill step
    held = replace(audio, rows_held=512 * MiB)
    assert held.peak == 3 * GiB + 512 * MiB - 16 * MiB
    assert ("audio prefill", GiB + 512 * MiB, "with requests' 512 MiB of encoder rows held") in held.phases()
    assert "the largest of" not in plain.table()
    with pytest.raises(ConfigError, match=r"floor 7.98 GiB \(the audio encoder\)"):
        plan_memory(floor_peak=images, **{**kwargs, "free_after_weights": 6 * GiB})


def released_omni_on_80_gib(least: bool) -> tuple[DeviceMemory, list[StageMemory]]:
    """Qwen3-Omni's stages as an 80 GB H100 measured them at the model's own length (65,536 tokens): the two
    pools' minimums (6.25 + 1.33 GiB) did not fit the 7.27 GiB the weights, the floor and the reserve left."""
    thinker_page, talker_page = 1600 * 1024, 320 * 1024
    thinker = StageMemory(
        peaks=(("audio encoder", int(3.8 * GiB), ""),),
        kv=(KVPool("Thinker", thinker_page, 4096, least_pages=512 if least else None),),
        graphs=(GraphCandidates("Thinker", "decode", "batch", {b: 40 * MiB for b in decode_buckets(64)}),),
    )
    talker = StageMemory(
        kv=(KVPool("Talker", talker_page, 4353, share=0.17, least_pages=800 if least else None),)
    )
    device = DeviceMemory(int(79.18 * GiB), int(11.56 * GiB), int(66.61 * GiB), None, "cuda:0")
    return device, [thinker, talker]


def test_a_pool_at_the_models_own_length_shrinks_to_start(caplog):
    device, stages = released_omni_on_80_gib(least=True)
    with caplog.at_level("WARNING", logger="omnistage.engine.memory.planner"):
        plan = plan_device(device, stages)
    thinker, talker = plan.kv_pool("Thinker"), plan.kv_pool("Talker")
    # each claimed less than one request of the longest length, the decode graphs came next, and the pools
    # took back all that was left: nothing of the memory is idle
    assert plan.captured("Thinker", "decode") == tuple(decode_buckets(64))
    assert 512 <= thinker.pages < 4096 and 800 <= talker.pages < 4353
    room = device.available - plan.floor - plan.reserve
    assert room - plan.graph_bytes - plan.kv_bytes < 1600 * 1024
    assert plan.free >= 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "Thinker" in warned[0] and "4,096 KV pages" in warned[0]
    assert "--max-model-len" in warned[0] and "Talker" in warned[1]


def test_a_configured_length_that_does_not_fit_stays_an_error():
    device, stages = released_omni_on_80_gib(least=False)
    with pytest.raises(ConfigError, match=r"Thinker KV 6\.25 GiB \(4,096 pages for one request\)"):
        plan_device(device, stages)


def test_a_pool_never_shrinks_below_its_least():
    device, stages = released_omni_on_80_gib(least=True)
    # 0.9 GiB beside the floor and the reserve; the least pages of both pools are 1.03 GiB
    with pytest.raises(ConfigError, match="do not fit"):
        plan_device(replace(device, free=int(5.2 * GiB)), stages)
    assert plan_device(replace(device, free=int(5.4 * GiB)), stages).kv_pool("Thinker").pages >= 512
    with pytest.raises(ValueError, match="least_pages"):
        KVPool("Thinker", 1, 10, least_pages=11)


def colocated_omni_at_80_gib() -> tuple[DeviceMemory, list[StageMemory]]:
    """configs/qwen3omni_colocated.yaml under an 80 GiB cap as an H200 planned it (74b1a3c): the Thinker's
    pool at the model's own length (4,096 pages, shrinkable), the Talker's fixed at 2 GiB; the minimums fit the
    8.94 GiB the weights, the floor and the reserve left, and the graphs had 0.66 GiB: Code2Wav's graphs
    stopped at 2 streams. Graph costs here are round numbers of that order (its 25x16 bucket most of them)."""
    thinker = StageMemory(
        peaks=(("audio encoder", int(3.8 * GiB), ""),),
        kv=(KVPool("Thinker", 1600 * 1024, 4096, least_pages=512),),
        graphs=(GraphCandidates("Thinker", "decode", "batch", {b: 18 * MiB for b in decode_buckets(64)}),),
    )
    code2wav_costs = {(25, s): 110 * MiB * s for s in (1, 2, 4, 8, 16)}
    talker = StageMemory(
        kv=(KVPool("Talker", 320 * 1024, 0, pages=6553),),
        graphs=(
            GraphCandidates("Code2Wav", "decode", "chunk x streams", code2wav_costs, pool="main stream"),
            GraphCandidates(
                "Talker", "prefill", "tokens", {t: 3 * MiB for t in (16, 32, 64)}, pool="main stream"
            ),
        ),
    )
    device = DeviceMemory(int(143.77 * GiB), int(76 * GiB), int(66.76 * GiB), 80 * GiB, "cuda:0")
    return device, [thinker, talker]


def test_a_pool_at_the_models_own_length_gives_way_to_the_graphs(caplog):
    device, stages = colocated_omni_at_80_gib()
    with caplog.at_level("WARNING", logger="omnistage.engine.memory.planner"):
        plan = plan_device(device, stages)
    # every graph a step of serving replays is captured, the Thinker's pool is what is left and still more than
    # its least; the fixed pool is as the config says
    assert plan.captured("Code2Wav", "decode") == tuple(sorted(stages[1].graphs[0].costs))
    assert plan.captured("Thinker", "decode") == tuple(decode_buckets(64))
    assert plan.captured("Talker", "prefill") == (16, 32, 64)
    thinker = plan.kv_pool("Thinker")
    assert 512 <= thinker.pages < 4096 and plan.kv_pool("Talker").pages == 6553
    room = device.available - plan.floor - plan.reserve
    assert 0 <= room - plan.graph_bytes - plan.kv_bytes < 1600 * 1024
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "Thinker" in warned[0] and "CUDA graphs" in warned[0]
    # a configured length keeps its pool whole: the graphs take what it leaves
    fixed = [replace(stages[0], kv=(replace(stages[0].kv[0], least_pages=None),)), stages[1]]
    plain = plan_device(device, fixed)
    assert plain.kv_pool("Thinker").pages >= 4096
    assert plain.captured("Code2Wav", "decode") != plan.captured("Code2Wav", "decode")


def test_the_pools_keep_half_of_the_room_from_the_graphs():
    device, stages = colocated_omni_at_80_gib()
    # graphs as large as the room: the pools still claim half of it, the graphs take what they can of the rest
    huge = {(25, s): int(3 * GiB) * s for s in (1, 2, 4)}
    stages[1] = replace(
        stages[1],
        graphs=(GraphCandidates("Code2Wav", "decode", "chunk x streams", huge, pool="main stream"),),
    )
    plan = plan_device(device, stages)
    room = device.available - plan.floor - plan.reserve
    assert plan.kv_bytes >= room // 2 - 1600 * 1024
    assert plan.captured("Code2Wav", "decode") == ((25, 1),)
