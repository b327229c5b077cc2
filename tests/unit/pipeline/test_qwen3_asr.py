"""Qwen3-ASR's pipeline: its own defaults where the config leaves a setting to them."""

from __future__ import annotations

import pytest

from omnistage.config import engine_config
from omnistage.models.qwen3_asr.tiny import make_tiny
from omnistage.pipeline.family import build_pipeline
from omnistage.pipeline.qwen3_asr import ASR_MAX_NUM_SEQS, ASR_STREAM_INTERVAL, asr_defaults


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("asr"))


def test_many_short_clips_at_once_unless_the_config_says_otherwise(checkpoint):
    pipeline = build_pipeline(engine_config(model=str(checkpoint), device="cpu", num_kv_pages=64))
    assert pipeline.config.stage("thinker").max_batch == ASR_MAX_NUM_SEQS == 128
    assert pipeline.thinker.scheduler.max_num_seqs == 128
    assert engine_config().stage("thinker").max_batch == 64  # Qwen3-Omni's default stays
    for given in ({"max_num_seqs": 16}, {"stages": {"thinker": {"max_batch": 16}}}):
        config = engine_config(model=str(checkpoint), device="cpu", **given)
        assert asr_defaults(config).stage("thinker").max_batch == 16


def test_a_transcript_streams_every_few_tokens_unless_the_config_says_otherwise(checkpoint):
    pipeline = build_pipeline(engine_config(model=str(checkpoint), device="cpu", num_kv_pages=64))
    assert pipeline.thinker.settings.engine.stream_interval == ASR_STREAM_INTERVAL == 4
    assert engine_config().engine_settings().stream_interval == 1  # Qwen3-Omni's default stays
    for given in (1, 8):
        config = engine_config(model=str(checkpoint), device="cpu", stream_interval=given)
        assert asr_defaults(config).engine_settings().stream_interval == given


def test_the_advertised_context_is_what_the_pool_holds(checkpoint):
    # 64 pages hold fewer tokens than the model's context: the server advertises (and lays prompts out within)
    # what one request can have, not a length the pool would refuse
    pipeline = build_pipeline(engine_config(model=str(checkpoint), device="cpu", num_kv_pages=64))
    held = 64 * pipeline.config.page_size
    assert held < pipeline.thinker.max_model_len
    assert pipeline.max_model_len == pipeline.frontend.max_model_len == held
    # a context shorter than the pool stays as set
    shorter = build_pipeline(
        engine_config(model=str(checkpoint), device="cpu", num_kv_pages=64, max_model_len=held // 2)
    )
    assert shorter.frontend.max_model_len == held // 2
