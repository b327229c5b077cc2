"""A text stage's needs (`text_stage_memory`) planned with another stage's on their device (`plan_devices`), on fake
measurements: the CUDA calls are stubbed with a device's numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from omnistage.config import engine_config
from omnistage.engine.attention import TorchReferenceBackend
from omnistage.engine.memory.floor import Floor
from omnistage.engine.memory.measure import Peak
from omnistage.engine.memory.plan import MAIN_POOL, GiB, StageMemory, scaled_costs
from omnistage.engine.stages.text_memory import text_stage_memory
from omnistage.errors import ConfigError
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni_loading import thinker_settings

PAGE_BYTES = 1 << 20


@dataclass
class FakeRunner:
    device: torch.device = torch.device("cuda", 0)
    dtype: torch.dtype = torch.bfloat16
    warmed: int = 0
    model: torch.nn.Module = field(default_factory=lambda: torch.nn.Linear(256, 256, bias=False))
    cfg: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(num_key_value_heads=4, head_dim=128))

    def profile_peak(self, tokens: int, seqs: int) -> Peak:
        return Peak(1000 * tokens, 10 * tokens)

    def warm_up(self, max_tokens: int) -> None:
        self.warmed = max_tokens


class FakeEncoders:
    def __init__(self) -> None:
        self.asked: tuple = ()
        self.audio_encoder = torch.nn.Linear(16, 16, bias=False)
        self.vision_encoder = None

    def profile_floor(
        self, prefill: int, tokens: int, max_prompt: int, audios: int, images: int, rows_held: int = 0
    ) -> Floor:
        self.asked = (prefill, tokens, max_prompt, audios, images, rows_held)
        return Floor(prefill, tokens)

    def default_graph_buckets(self) -> tuple[list[int], list[int]]:
        return [1, 2, 4, 8], []

    def graph_costs(self, audio: list[int], vision: list[int]) -> dict[str, dict[int, Peak]]:
        self.priced = (audio, vision)
        return {"audio": {b: Peak(b << 20, b << 10) for b in audio}}


@pytest.fixture
def device(monkeypatch):
    """A 40 GiB device with 10 GiB of weights loaded."""
    for name, value in {
        "synchronize": None,
        "empty_cache": None,
        "memory_allocated": 10 * GiB,
        "memory_reserved": 10 * GiB,
        "mem_get_info": (30 * GiB, 40 * GiB),
    }.items():
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value, **k: v)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a, **k: None)


def plan(**config):
    runner = FakeRunner(**{k: config.pop(k) for k in ["dtype", "model"] if k in config})
    encoders = FakeEncoders()
    cfg = engine_config(device="cuda", max_num_seqs=8, max_prefill_graph_tokens=64, **config)
    others = StageMemory(
        resident=(("Talker", 2 * GiB, "weights"), ("Talker KV pages", GiB, "64 pages")),
        peaks=(("Code2Wav", 3 * 10**9, "16 streams"),),
    )
    need = text_stage_memory(runner, encoders, thinker_settings(cfg), PAGE_BYTES, 4095, (8, 5))
    gpu = torch.device("cuda", 0)
    result = plan_devices([(gpu, need), (gpu, others)], cfg.gpu_memory_limit_gib)[gpu]
    return result, runner, encoders


def test_the_floor_takes_the_largest_of_the_stage_and_the_other_stages(device):
    result, runner, encoders = plan()
    assert encoders.asked == (2048 * 1000, 2048, 4095, 8, 5, 512 << 20)  # rows held: the default
    assert result.floor == 3 * 10**9  # Code2Wav's, beats 2048 x 1000 bytes
    assert [name for name, _, _ in result.phases] == ["text prefill", "Code2Wav"]
    assert result.resident == (
        ("Thinker", 256 * 256 * 4, "weights"),
        ("audio encoder", 16 * 16 * 4, "weights"),
        ("Talker", 2 * GiB, "weights"),
        ("Talker KV pages", GiB, "64 pages"),
    )
    table = result.table()
    assert "memory plan (device: 40.00 GiB) on cuda:0" in table
    assert "  Talker KV pages" in table and "  Code2Wav  " in table
    assert runner.warmed == 2048
    assert result.captured("Thinker", "decode") == (1, 2, 4, 8)
    assert result.captured("Thinker", "prefill") == (16, 24, 32, 48, 64)
    # at least a request of the longest length: 4,096 tokens in 16-token pages
    assert result.kv_pool("Thinker").pool.min_pages == 256 and result.kv_pool("Thinker").pages > 256


class Gathering(TorchReferenceBackend):
    """A backend whose long steps gather their keys (as the GPU's with torch's FlashAttention)."""

    def scratch_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 1000 * kv_heads * head_dim


def test_the_text_prefill_phase_counts_the_long_prefill_gather(device):
    layer = torch.nn.Linear(256, 256, bias=False)
    layer.backend = Gathering()
    _, _, encoders = plan(model=torch.nn.Sequential(layer))
    assert encoders.asked[0] == 2048 * 1000 + 1000 * 4 * 128  # the profiled step's peak, then the gather


def test_the_audio_encoder_graphs_compete_in_the_plan(device):
    result, _, encoders = plan()
    assert encoders.priced == ([1, 2, 4, 8], [])
    assert result.captured("audio encoder", "prefill") == (1, 2, 4, 8)
    # in the main-stream pool with the prefill graphs (the decode graphs, replayed beside the speech stages,
    # keep theirs), each keeping 1 KiB per window and sharing the largest scratch (8 MiB - 8 KiB)
    audio = result.graph_set("audio encoder", "prefill")
    assert (
        audio.candidates.pool_name == result.graph_set("Thinker", "prefill").candidates.pool_name == MAIN_POOL
    )
    assert result.graph_set("Thinker", "decode").candidates.pool_name != MAIN_POOL
    assert audio.bytes == ((1 + 2 + 4 + 8) << 10) + (8 << 20) - (8 << 10)
    limited, _, encoders = plan(stages={"encoders": {"audio_graphs": {"max": 2}}})
    assert encoders.priced == ([1, 2], []) and limited.captured("audio encoder", "prefill") == (1, 2)
    flagged, _, encoders = plan(max_audio_graph_windows=4)  # --max-audio-graph-windows
    assert encoders.priced == ([1, 2, 4], []) and flagged.captured("audio encoder", "prefill") == (1, 2, 4)
    none, _, _ = plan(max_audio_graph_windows=0)  # the tower eager, the Thinker's graphs as before
    assert none.graph_set("audio encoder", "prefill") is None and none.captured("Thinker", "prefill")
    eager, _, _ = plan(stages={"encoders": {"enforce_eager": True}})
    assert eager.graph_set("audio encoder", "prefill") is None and eager.captured("Thinker", "decode") == (
        1,
        2,
        4,
        8,
    )


def test_fixed_pages_beyond_what_fits_name_the_stage(device):
    with pytest.raises(ConfigError, match=r"\+ Thinker KV 976.56 GiB \(1,000,000 pages asked for\) = "):
        plan(num_kv_pages=10**6)
    fixed = plan(num_kv_pages=100)[0]
    assert fixed.kv_pool("Thinker").pages == 100 and fixed.free > 10 * GiB
    assert plan(kv_cache_memory_gib=0.5)[0].kv_pool("Thinker").pages == 512


def test_no_graphs_without_bfloat16(device, caplog):
    result, _, _ = plan(dtype=torch.float16)
    assert result.graphs == () and result.graph_bytes == 0
    assert "CUDA graphs need bfloat16" in caplog.text
    assert "CUDA graphs                   0.00 GiB  none" in result.table()


def test_scaled_costs_grow_with_the_bucket():
    costs = scaled_costs(8 << 20, [1, 2, 4, 8])
    assert costs[8] == (8 << 20) + (2 << 20) and costs[1] == (1 << 20) + (2 << 20)


def test_only_the_models_own_length_may_shrink(device):
    """At the model's length the pool may shrink to 8,192 tokens when one request does not fit
    (`plan_device`); at a length the config sets, one request of it is a hard need."""

    def pool(**config):
        cfg = engine_config(device="cuda", max_num_seqs=8, max_prefill_graph_tokens=64, **config)
        need = text_stage_memory(
            FakeRunner(), FakeEncoders(), thinker_settings(cfg), PAGE_BYTES, 65535, (8, 5)
        )
        return need.kv[0]

    own = pool()
    assert (own.min_pages, own.least_pages) == (4096, 512)
    assert pool(max_model_len=65536).least_pages is None
