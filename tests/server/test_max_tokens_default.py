"""Generation is bounded by default: a server-wide `max_tokens_default` for chat and completions (small on the
embedded tiny model), and a cap derived from the clip's length for transcriptions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from omnistage.cli import build_parser
from omnistage.config import engine_config, load_config
from omnistage.errors import ConfigError
from omnistage.models.qwen3_omni.transcription import max_transcription_tokens
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"  # 2.98 s
EXAMPLE = Path(__file__).parents[2] / "configs" / "tiny.yaml"
FORCED = {"ignore_eos": True, "temperature": 0}


def test_the_setting_and_its_defaults():
    assert engine_config().max_tokens_default == 256  # the embedded tiny model answers promptly
    assert engine_config(model="/models/real").max_tokens_default is None  # a real model: to the context
    assert engine_config(max_tokens_default=None).max_tokens_default is None
    assert engine_config(model="/m", max_tokens_default=64).max_tokens_default == 64
    with pytest.raises(ConfigError, match="max_tokens_default: Input should be greater than or equal to 1"):
        engine_config(max_tokens_default=0)
    assert load_config(EXAMPLE).max_tokens_default == 256
    assert build_parser().parse_args(["serve", "--max-tokens-default", "32"]).max_tokens_default == 32


@pytest.fixture(scope="module")
def bounded(tiny_checkpoint):
    config = engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=64, max_tokens_default=4)
    engine = AsyncPipeline.from_config(config)
    try:
        yield TestClient(build_app(engine, "tiny"))
    finally:
        engine.shutdown()


def test_chat_without_max_tokens_takes_the_default(bounded):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **FORCED}
    usage = bounded.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == 4
    usage = bounded.post("/v1/chat/completions", json=body | {"max_completion_tokens": 6}).json()["usage"]
    assert usage["completion_tokens"] == 6


def test_completions_with_null_max_tokens_take_the_default(bounded):
    body = {"model": "tiny", "prompt": "Hi", **FORCED}
    assert (
        bounded.post("/v1/completions", json=body | {"max_tokens": None}).json()["usage"]["completion_tokens"]
        == 4
    )
    assert (
        bounded.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16
    )  # OpenAI's default


def test_max_transcription_tokens_grows_with_the_audio():
    assert max_transcription_tokens(0.0) == 32
    assert max_transcription_tokens(2.98) == 32 + 16 * 3
    assert max_transcription_tokens(300.0) == 32 + 16 * 300


def test_a_transcription_stops_at_the_cap_of_its_audio(tiny_pipeline):
    client = TestClient(build_app(tiny_pipeline, "tiny"))

    def output_tokens(**fields: str) -> int:
        data = {"model": "tiny", "stream": "true", "ignore_eos": "true"} | fields
        r = client.post("/v1/audio/transcriptions", data=data, files={"file": ("s.wav", SPEECH.read_bytes())})
        assert r.status_code == 200, r.text
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: {")]
        done = json.loads(events[-1])
        assert done["type"] == "transcript.text.done"
        return done["usage"]["output_tokens"]

    assert output_tokens() == max_transcription_tokens(2.98)
    # The client's max_tokens (an extra beyond OpenAI's form) still decides when given.
    assert output_tokens(max_tokens="3") == 3
