"""The `stages:` section of the engine settings: the shipped topologies, each stage's resolved settings, the
keys of the first layout naming their place, flags over the file, and every error `validate_topology` and the
schema give, each naming its YAML key."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.cli import main
from omnistage.config import EngineConfig, engine_config, load_config
from omnistage.engine.buckets import decode_buckets, prefill_buckets
from omnistage.errors import ConfigError
from omnistage.pipeline.topology import validate_topology

CONFIGS = Path(__file__).parents[2] / "configs"
COLOCATED, TWO_GPU, TINY = (CONFIGS / f"{n}.yaml" for n in ("qwen3omni_colocated", "qwen3omni_2gpu", "tiny"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return path


def test_the_colocated_topology_puts_every_stage_on_one_gpu():
    config = load_config(COLOCATED)
    assert set(validate_topology(config, device_count=1).values()) == {"cuda:0"}
    thinker, talker, code2wav = config.stage("thinker"), config.stage("talker"), config.stage("code2wav")
    assert thinker.graphs.sizes(decode_buckets) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert thinker.prefill_graphs.sizes(prefill_buckets)[-1] == 512
    assert thinker.kv.pages is thinker.kv.gib is thinker.kv.share is None  # all the plan leaves
    assert talker.kv.gib == 2 and talker.max_batch == 64
    assert (code2wav.first_chunk, code2wav.chunk, code2wav.max_streams) == (2, 25, 16)
    assert code2wav.graphs.sizes(decode_buckets) == [1, 2, 4, 8, 16]
    assert config.stage("encoders").vision_graphs.max == 8192
    assert (config.stage("talker").device, config.stage("code2wav").device) == ("cuda:0", "cuda:0")


def test_the_two_gpu_topology_splits_thinker_and_speech():
    config = load_config(TWO_GPU)
    assert validate_topology(config, device_count=2) == {
        "thinker": "cuda:0",
        "encoders": "cuda:0",
        "talker": "cuda:1",
        "code_predictor": "cuda:1",
        "code2wav": "cuda:1",
    }
    assert config.stage("talker").device == "cuda:1" and config.stage("talker").kv.gib == 8


def test_the_tiny_example_places_every_stage_on_the_cpu():
    config = load_config(TINY)
    assert set(validate_topology(config, device_count=0).values()) == {"cpu"}
    assert config.stage("thinker").kv.pages == 256
    assert config.stage("talker").kv.gib == 0.25
    assert config.stage("thinker").graphs.sizes(
        decode_buckets
    )  # the ladder is there; a CPU runner ignores it


def test_stages_follow_the_engine_and_each_other_by_default():
    config = engine_config(
        device="cuda", max_num_seqs=8, stages={"talker": {"device": "cuda:1"}, "code2wav": {"max_streams": 4}}
    )
    assert config.stage("thinker").device == config.stage("encoders").device == "cuda"
    assert config.stage("code_predictor").device == config.stage("code2wav").device == "cuda:1"
    assert config.stage("code2wav").max_streams == 4
    assert config.stage("talker").max_batch == config.stage("code_predictor").max_batch == 8
    assert config.stage("thinker").graphs.sizes(decode_buckets) == [1, 2, 4, 8]  # up to 128, capped
    eager = engine_config(enforce_eager=True, stages={"talker": {"enforce_eager": False}})
    assert eager.stage("thinker").graphs.sizes(decode_buckets) == []
    assert eager.stage("talker").graphs.sizes(decode_buckets) == decode_buckets(64)
    listed = engine_config(stages={"code_predictor": {"graphs": {"buckets": [1, 3, 5]}}})
    assert listed.stage("code_predictor").graphs.sizes(decode_buckets) == [1, 3, 5]
    # the Talker's prefill graphs follow the Thinker's unless given their own
    follows = engine_config(max_prefill_graph_tokens=64)
    assert follows.stage("talker").prefill_graphs.sizes(prefill_buckets) == prefill_buckets(64)
    own = engine_config(stages={"talker": {"prefill_graphs": {"buckets": [16, 48]}}})
    assert own.stage("talker").prefill_graphs.sizes(prefill_buckets) == [16, 48]
    assert eager.stage("talker").prefill_graphs.sizes(prefill_buckets) == prefill_buckets(2048)
    assert listed.stage("encoders").audio_graphs.sizes(decode_buckets, default_max=4) == [1, 2, 4]


def test_the_talkers_step_budget_is_the_engines_at_least_8192_unless_given_its_own():
    config = engine_config()
    budgets = (config.stage("thinker").max_num_batched_tokens, config.stage("talker").max_num_batched_tokens)
    assert budgets == (2048, 8192)
    assert config.stage("talker").prefill_graphs.sizes(prefill_buckets) == prefill_buckets(
        2048
    )  # the Thinker's
    large = engine_config(max_num_batched_tokens=16384)
    assert large.stage("talker").max_num_batched_tokens == 16384
    own = engine_config(talker_max_num_batched_tokens=4096)
    assert own.stage("talker").max_num_batched_tokens == 4096
    # a budget below the Thinker's prefill graphs keeps only the graphs its steps can reach
    small = engine_config(talker_max_num_batched_tokens=256)
    assert small.stage("talker").prefill_graphs.sizes(prefill_buckets) == prefill_buckets(256)
    listed = engine_config(
        stages={"thinker": {"prefill_graphs": {"buckets": [64, 512, 1024]}}},
        talker_max_num_batched_tokens=512,
    )
    assert listed.stage("talker").prefill_graphs.sizes(prefill_buckets) == [64, 512]


def test_the_engine_wide_settings_a_stage_reads_are_the_configs():
    config = engine_config(
        page_size=32, max_num_batched_tokens=512, max_model_len=4096, enforce_eager=True, compile=False
    )
    engine = config.engine_settings()
    assert (engine.page_size, engine.max_num_batched_tokens, engine.max_model_len) == (32, 512, 4096)
    assert engine.enforce_eager and not engine.compile and engine.decode_ahead
    assert (engine.moe_kernel, engine.max_tokens_default) == ("auto", 256)  # the embedded model's default


def test_a_config_crosses_to_the_engine_process_unchanged():
    config = load_config(TWO_GPU, max_num_seqs=None)
    again = EngineConfig.model_validate_json(config.model_dump_json())
    assert again.model_dump() == config.model_dump()
    assert validate_topology(again, 2) == validate_topology(config, 2)


def test_flags_override_the_stage_keys_they_name():
    config = load_config(COLOCATED, max_graph_batch=8, max_num_seqs=16)
    assert config.stage("thinker").graphs.sizes(decode_buckets) == [1, 2, 4, 8]
    assert config.stage("thinker").max_batch == 16
    assert load_config(TINY, kv_cache_memory_gib=1.0).stage("thinker").kv.gib == 1.0  # the file's pages go
    on_cpu = load_config(TWO_GPU, device="cpu", enforce_eager=True)
    assert set(validate_topology(on_cpu, device_count=0).values()) == {"cpu"}
    assert on_cpu.stage("talker").graphs.sizes(decode_buckets) == []


def test_a_mistyped_stage_key_stops_the_server_with_its_path(tmp_path, capsys):
    bad = write(tmp_path, "engine:\n  stages:\n    talker:\n      graps: {max: 8}\n")
    with pytest.raises(ConfigError, match=r"topology.yaml: engine.stages.talker.graps: unknown key"):
        load_config(bad)
    bad = write(tmp_path, "engine:\n  stages:\n    code2wav:\n      graphs: {maximum: 8}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "engine.stages.code2wav.graphs.maximum: unknown key" in capsys.readouterr().err
    bad = write(tmp_path, "engine:\n  stages:\n    vocoder: {}\n")
    with pytest.raises(ConfigError, match=r"engine.stages.vocoder: unknown key"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"engine.stages.talker.device: String should match pattern"):
        load_config(write(tmp_path, "engine:\n  stages:\n    talker: {device: gpu1}\n"))


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            {"thinker": {"graphs": {"buckets": [8, 4]}}},
            r"stages.thinker.graphs.buckets: \[8, 4\]: list each size once, in ascending order",
        ),
        (
            {"talker": {"graphs": {"buckets": [1], "max": 4}}},
            r"stages.talker.graphs: give buckets or max, not both",
        ),
        (
            {"talker": {"max_batch": 4, "graphs": {"buckets": [1, 8]}}},
            r"stages.talker.graphs.buckets: 8 is above stages.talker.max_batch \(4\), which no step exceeds: "
            r"lower it to 4 or raise stages.talker.max_batch",
        ),
        (
            {"thinker": {"max_batch": 16, "graphs": {"max": 32}}},
            r"stages.thinker.graphs.max: 32 is above stages.thinker.max_batch \(16\)",
        ),
        ({"code2wav": {"max_streams": 8, "graphs": {"max": 16}}}, r"stages.code2wav.graphs.max: 16 is above"),
        (
            {"code_predictor": {"max_batch": 2, "graphs": {"max": 4}}},
            r"stages.code_predictor.graphs.max: 4 is above stages.code_predictor.max_batch \(2\)",
        ),
        (
            {"thinker": {"prefill_graphs": {"max": 4096}}},
            r"stages.thinker.prefill_graphs.max: 4096 is above max_num_batched_tokens \(2048\)",
        ),
        (
            {"talker": {"prefill_graphs": {"max": 16384}}},
            r"stages.talker.prefill_graphs.max: 16384 is above stages.talker.max_num_batched_tokens \(8192\)",
        ),
        (
            {"talker": {"max_num_batched_tokens": 1024, "prefill_graphs": {"max": 2048}}},
            r"stages.talker.prefill_graphs.max: 2048 is above stages.talker.max_num_batched_tokens \(1024\)",
        ),
        (
            {"talker": {"num_kv_pages": 64, "kv_share": 0.2}},
            r"stages.talker.kv_share: the Talker's KV pool is already sized by stages.talker.num_kv_pages",
        ),
    ],
)
def test_the_schema_names_the_key_at_fault(stages, message):
    with pytest.raises(ConfigError, match=message):
        engine_config(stages=stages)


def test_a_key_of_the_first_layout_names_its_place(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"topology.yaml: engine.code2wav_max_batch: this setting is stages.code2wav.max_streams now: give "
        r"it there",
    ):
        load_config(write(tmp_path, "engine:\n  code2wav_max_batch: 8\n"))
    with pytest.raises(
        ConfigError,
        match=r"engine.max_num_seqs: this setting is stages.thinker.max_batch now \(the command line's "
        r"--max-num-seqs sets it too\)",
    ):
        load_config(write(tmp_path, "engine:\n  max_num_seqs: 8\n"))
    with pytest.raises(
        ConfigError, match=r"^arguments: speech_device: this setting is stages.talker.device now"
    ):
        engine_config(speech_device="cuda:1")


def test_a_flags_keyword_and_its_stage_key_must_agree():
    with pytest.raises(
        ConfigError, match=r"max_num_seqs: 8, but stages.thinker.max_batch is 4: they are one setting"
    ):
        engine_config(max_num_seqs=8, stages={"thinker": {"max_batch": 4}})
    with pytest.raises(ConfigError, match=r"kv_cache_memory_gib: the Thinker's KV pool is already sized by "):
        engine_config(num_kv_pages=64, stages={"thinker": {"kv_cache_memory_gib": 1.0}})
    with pytest.raises(
        ConfigError,
        match=r"^arguments: stages.thinker.kv_cache_memory_gib: .* sized by stages.thinker.num_kv_pages",
    ):
        engine_config(num_kv_pages=64, kv_cache_memory_gib=1.0)
    assert engine_config(max_num_seqs=8, stages={"thinker": {"max_batch": 8}}).stage("thinker").max_batch == 8


def topology_error(device_count: int, **values) -> str:
    with pytest.raises(ConfigError) as error:
        validate_topology(engine_config(**values), device_count)
    return str(error.value)


def test_a_stage_on_a_gpu_the_machine_lacks():
    config = load_config(TWO_GPU)
    with pytest.raises(ConfigError) as error:
        validate_topology(config, device_count=1)
    assert str(error.value) == (
        f"{TWO_GPU}: engine.stages.talker.device: cuda:1, but this machine has 1 GPU (cuda:0): place the stage "
        "on a GPU it has, or on cpu"
    )
    assert topology_error(0, device="cuda") == (
        "engine.device: cuda, but this machine has no GPU: place the stage on a GPU it has, or on cpu"
    )
    assert topology_error(2, stages={"talker": {"device": "cuda:2"}}).startswith(
        "engine.stages.talker.device: cuda:2, but this machine has 2 GPUs (cuda:0 to cuda:1)"
    )
    assert validate_topology(engine_config(speech=False, stages={"talker": {"device": "cuda:3"}}), 1) == {
        "thinker": "cuda:0",
        "encoders": "cuda:0",
    }  # the speech stages are not loaded


def test_stages_that_must_share_a_device():
    assert topology_error(2, stages={"encoders": {"device": "cuda:1"}}) == (
        "engine.stages.encoders.device: cuda:1, but the Thinker is on cuda:0 and their rows go straight into "
        "the Thinker's prefill: put both on the same device"
    )
    assert topology_error(
        2, stages={"talker": {"device": "cuda:1"}, "code_predictor": {"device": "cuda:0"}}
    ) == (
        "engine.stages.code_predictor.device: cuda:0, but the Talker is on cuda:1 and it runs inside every "
        "Talker step: put both on the same device"
    )


def test_a_pool_of_pages_too_small_for_one_request():
    assert topology_error(0, num_kv_pages=100, max_model_len=4096) == (
        "engine.stages.thinker.num_kv_pages: 100 pages of 16 tokens hold 1,600 tokens, less than one request of 4,096: give "
        "at least 256 pages, or a shorter max_model_len"
    )
    config = engine_config(
        page_size=4, stages={"thinker": {"num_kv_pages": 10}, "talker": {"num_kv_pages": 10}}
    )
    assert validate_topology(config, 0, max_len={"thinker": 40})  # exactly one request fits
    with pytest.raises(
        ConfigError, match=r"^engine.stages.thinker.num_kv_pages: 10 pages of 4 tokens hold 40"
    ):
        validate_topology(config, 0, max_len={"thinker": 41})
    with pytest.raises(ConfigError, match=r"^engine.stages.talker.num_kv_pages: .* at least 13 pages"):
        validate_topology(config, 0, max_len={"talker": 50})


def test_graphs_asked_of_a_cpu_stage():
    assert topology_error(0, stages={"talker": {"device": "cpu", "graphs": {"max": 8}}}) == (
        "engine.stages.talker.graphs: CUDA graphs need a GPU and this stage runs on the CPU: remove the key or "
        "set stages.talker.enforce_eager: true"
    )
    message = topology_error(0, stages={"encoders": {"vision_graphs": {"buckets": [1024]}}})
    assert message.startswith("engine.stages.encoders.vision_graphs: CUDA graphs need a GPU")
    eager = engine_config(device="cpu", stages={"talker": {"graphs": {"max": 8}, "enforce_eager": True}})
    assert validate_topology(eager, 0)["talker"] == "cpu"


def test_kv_shares():
    assert topology_error(0, stages={"talker": {"kv_share": 0.5}}) == (
        "engine.stages.talker.kv_share: a share of the planned memory needs a GPU; on the CPU give num_kv_pages "
        "or kv_cache_memory_gib"
    )
    assert topology_error(1, stages={"thinker": {"kv_share": 0.8}, "talker": {"kv_share": 0.3}}) == (
        "engine.stages.talker.kv_share: the KV shares of the stages on cuda:0 add up to 1.1, more than all of "
        "it: lower them to a sum of at most 1"
    )
    two = engine_config(
        stages={"thinker": {"kv_share": 0.8}, "talker": {"kv_share": 0.3, "device": "cuda:1"}}
    )
    assert validate_topology(two, 2)["talker"] == "cuda:1"  # shares of different devices
