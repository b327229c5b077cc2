"""The code predictor and Code2Wav as stages of the one protocol (CPU, tiny checkpoint): what each brings
to its device's plan and takes of it; the plan itself is measured on a GPU (tests/gpu)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest

from omnistage import LLM
from omnistage.engine.memory.measure import Peak, module_bytes
from omnistage.engine.stages import code2wav as code2wav_stage
from omnistage.engine.stages.base import Stage
from omnistage.engine.stages.code2wav import Code2WavStage
from omnistage.engine.stages.frames import FrameStage


@pytest.fixture(scope="module")
def speech(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4).pipeline.speech_stages


def test_every_speech_stage_is_a_stage_in_the_order_they_share_a_pool(speech):
    names = [stage.name for stage in speech.stages]
    assert names == ["Talker", "code predictor", "Code2Wav"]
    assert all(isinstance(stage, Stage) for stage in speech.stages)
    assert isinstance(speech.frame_stage, FrameStage) and isinstance(speech.code2wav_stage, Code2WavStage)
    # the streamer decodes through the Code2Wav stage's graphs, the hand-off through the predictor's
    assert speech.streamer.decode is speech.code2wav_stage.graphs
    assert speech.frame_graphs is speech.frame_stage.graphs


def test_the_code_predictor_brings_its_weights_and_no_graphs_off_cuda(speech):
    need = speech.frame_stage.memory()
    assert need.resident == (("code predictor", module_bytes(speech.code_predictor), "weights"),)
    assert need.resident[0][1] > 0 and need.graphs == () and need.kv == () and need.peaks == ()


def test_code2wav_brings_its_weights_and_a_state_slot_per_speaking_request(speech, monkeypatch):
    """Its state: a slot for each speaking request the pipeline lets in at once (eagerly, a Code2Wav call's
    streams), plus the scratch slot padding rows write. (Its peak is measured on a GPU only: here a measure
    that reads nothing; off CUDA no graphs.)"""
    monkeypatch.setattr(code2wav_stage, "device_peak", lambda device: contextlib.nullcontext(Peak()))
    need = speech.code2wav_stage.memory()
    config = speech.config
    slots = min(config.stage("talker").max_batch, config.stage("code2wav").max_streams)
    assert slots == speech.speaking == 16
    state = speech.code2wav_stage.decoder.state
    assert state.scratch == slots and all(t.shape[0] == slots + 1 for t in state.tails)
    assert need.resident == (
        ("Code2Wav", module_bytes(speech.code2wav), "weights"),
        ("Code2Wav streams", state.nbytes, f"{slots} state slots"),
    )
    assert need.graphs == () and need.kv == () and need.peaks[0][1] == 0


def test_code2wav_slots_stop_at_the_talker_batch_and_a_call_where_more_may_speak(tiny_checkpoint):
    """With more speaking requests let in than the Talker runs, the slots are its batch and a call's streams:
    the streams of requests waiting for the Talker have no frames to decode yet."""
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, max_num_speaking=100)
    speech = llm.pipeline.speech_stages
    talker, streams = speech.config.stage("talker").max_batch, speech.config.stage("code2wav").max_streams
    assert speech.speaking == 100 > talker + streams
    assert speech.code2wav_stage.decoder.slots == talker + streams


@dataclass
class Granted:
    """A plan's grant as a stage reads it (`MemoryPlan.captured`)."""

    buckets: dict[str, tuple[Any, ...]]

    def captured(self, stage: str, kind: str) -> tuple[Any, ...]:
        assert kind == "decode"
        return self.buckets.get(stage, ())


def test_each_stage_captures_what_the_plan_grants_it_and_they_share_one_pool(speech, monkeypatch):
    seen: dict[str, tuple[list, Any]] = {}

    def recorder(name: str):
        def capture(buckets, pool=None):
            seen[name] = (sorted(buckets), pool)
            return sorted(buckets)

        return capture

    monkeypatch.setattr(speech.frame_stage.graphs, "capture", recorder("frames"))
    monkeypatch.setattr(speech.code2wav_stage.graphs, "capture", recorder("code2wav"))
    monkeypatch.setattr(speech.talker_stage, "allocate", lambda plan, pool=None: None)
    plan = Granted({"code predictor": (1, 4), "Code2Wav": ((25, 1), (25, 2))})
    pool = object()
    speech.allocate(plan, pool)  # type: ignore[arg-type]
    assert seen == {"frames": ([1, 4], pool), "code2wav": ([(25, 1), (25, 2)], pool)}
