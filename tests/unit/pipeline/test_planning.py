"""One plan per device for every stage on it (`plan_devices`), and the Qwen3-Omni pipeline's grants: the
Thinker's first, whose graph pool the speech stages join on a device they share with it. Fakes: no GPU."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import omnistage.pipeline.planning as planning
from omnistage.engine.memory.plan import DeviceMemory, GiB, KVPool, StageMemory
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni import Qwen3OmniPipeline

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture
def read(monkeypatch):
    """Each device read once, as 40 GiB with 10 GiB loaded."""
    reads = []

    def read_device(device, limit_gib):
        reads.append((device, limit_gib))
        return DeviceMemory(total=40 * GiB, free=30 * GiB, allocated=10 * GiB, name=str(device))

    monkeypatch.setattr(planning, "read_device", read_device)
    return reads


def need(stage: str, peak: int) -> StageMemory:
    """A stage with a step of `peak` bytes and a KV pool; past the Thinker's, a pool takes a share."""
    share = None if stage == "Thinker" else 0.25
    return StageMemory(peaks=((f"{stage} step", peak, ""),), kv=(KVPool(stage, 1 << 20, 16, share=share),))


def test_every_stage_on_a_device_is_in_its_one_plan(read):
    plans = plan_devices([(GPU0, need("Thinker", GiB)), (GPU1, need("Talker", 2 * GiB)),
                          (GPU0, need("encoders", 3 * GiB))], 80.0)  # fmt: skip
    assert read == [(GPU0, 80.0), (GPU1, 80.0)]
    assert [kv.pool.stage for kv in plans[GPU0].kv] == ["Thinker", "encoders"]
    assert plans[GPU0].floor == 3 * GiB and plans[GPU1].floor == 2 * GiB  # the largest step of the device's
    assert plan_devices([], None) == {}


class FakeStage:
    def __init__(self, device: torch.device, name: str, granted: list) -> None:
        self.device, self.name, self.granted, self.graph_pool = device, name, granted, f"{name} pool"

    def memory(self, *shared: bool) -> StageMemory:
        return need(self.name, GiB)

    def allocate(self, plan, pool=None) -> None:
        self.granted.append((self.name, plan.device.name, [kv.pool.stage for kv in plan.kv], pool))

    def on_device(self):
        return contextlib.nullcontext()


def pipeline_of(thinker: torch.device, speech: torch.device | None) -> tuple[Qwen3OmniPipeline, list]:
    granted: list = []
    pipeline = Qwen3OmniPipeline.__new__(Qwen3OmniPipeline)
    pipeline.config = SimpleNamespace(gpu_memory_limit_gib=None)
    pipeline.thinker = FakeStage(thinker, "Thinker", granted)
    pipeline.speech_stages = FakeStage(speech, "Talker", granted) if speech is not None else None
    return pipeline, granted


def test_a_shared_gpu_is_planned_once_and_the_speech_stages_join_the_thinkers_pool(read):
    pipeline, granted = pipeline_of(GPU0, GPU0)
    plans = pipeline._plan(shared=True)
    assert list(plans) == [GPU0] and len(read) == 1
    assert granted == [
        ("Thinker", "cuda:0", ["Thinker", "Talker"], None),
        ("Talker", "cuda:0", ["Thinker", "Talker"], "Thinker pool"),
    ]


def test_two_gpus_are_planned_apart_and_the_speech_stages_keep_their_own_pool(read):
    pipeline, granted = pipeline_of(GPU0, GPU1)
    assert list(pipeline._plan(shared=False)) == [GPU0, GPU1]
    assert granted == [("Thinker", "cuda:0", ["Thinker"], None), ("Talker", "cuda:1", ["Talker"], None)]


def test_on_the_cpu_nothing_is_planned(read):
    pipeline, granted = pipeline_of(torch.device("cpu"), torch.device("cpu"))
    assert pipeline._plan(shared=True) == {} and granted == [] and read == []
    text_only, granted = pipeline_of(GPU0, None)
    assert list(text_only._plan(shared=True)) == [GPU0] and granted == [
        ("Thinker", "cuda:0", ["Thinker"], None)
    ]
