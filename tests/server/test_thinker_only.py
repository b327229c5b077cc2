"""The Thinking and Captioner checkpoints (the Thinker alone, `enable_audio_output` false) served from their
tiny checkpoints on the CPU, in process, through the openai SDK: text out, no Talker loaded or planned, and
every request for speech a 400 naming its field."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from safetensors import safe_open

from omnistage.config import engine_config
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
MODEL = "thinker-only"


def serve(checkpoint: Path) -> Iterator[tuple[AsyncPipeline, openai.OpenAI]]:
    pipeline = AsyncPipeline.from_config(engine_config(model=str(checkpoint), device="cpu", num_kv_pages=64))
    try:
        http = TestClient(build_app(pipeline, MODEL))
        yield (
            pipeline,
            openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0),
        )
    finally:
        pipeline.shutdown()


@pytest.fixture(scope="module")
def thinking(tiny_thinking_checkpoint) -> Iterator[tuple[AsyncPipeline, openai.OpenAI]]:
    yield from serve(tiny_thinking_checkpoint)


def test_the_checkpoint_holds_the_thinker_alone(tiny_thinking_checkpoint):
    with safe_open(str(tiny_thinking_checkpoint / "model.safetensors"), "pt") as f:
        prefixes = {name.split(".")[0] for name in f.keys()}
    assert prefixes == {"thinker"}


def test_thinking_serves_text_and_plans_no_talker(thinking):
    pipeline, client = thinking
    assert pipeline.frontend.voices == ()
    assert "talker" not in pipeline.memory_summary().lower()
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    message = reply.choices[0].message
    text = (message.content or "") + ((message.model_extra or {}).get("reasoning_content") or "")
    assert reply.usage.completion_tokens == 4 and text


def test_speech_is_refused_with_the_reason(thinking):
    _, client = thinking
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    assert error.value.body["param"] == "modalities"
    assert "no talker" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.audio.speech.create(model=MODEL, input="Hi", voice="alloy", response_format="wav")
    assert "no talker" in error.value.body["message"]


def test_the_captioner_captions_a_clip(tiny_captioner_checkpoint):
    for _, client in serve(tiny_captioner_checkpoint):
        clip = base64.b64encode(SPEECH.read_bytes()).decode()
        audio = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [audio]}], max_tokens=6, temperature=0
        )
        assert reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens_details.audio_tokens > 0


@pytest.fixture(scope="module")
def opened(thinking_template_checkpoint) -> Iterator[tuple[AsyncPipeline, openai.OpenAI]]:
    yield from serve(thinking_template_checkpoint)


def test_a_reply_begun_inside_the_think_block_is_reasoning(opened):
    """The template opens the block, so the model's tokens (the parser on by default: no Talker) are
    reasoning until it closes it, streamed and whole alike; with thinking turned off they are the answer."""
    _, client = opened
    messages = [{"role": "user", "content": "Hi"}]
    fields = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    whole = client.chat.completions.create(**fields).choices[0].message
    assert whole.content == "" and whole.model_extra["reasoning_content"], whole
    streamed = [
        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for chunk in client.chat.completions.create(**fields, stream=True)
        if chunk.choices
    ]
    assert "".join(streamed) == whole.model_extra["reasoning_content"]
    off = client.chat.completions.create(
        **fields, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.choices[0].message.content and "reasoning_content" not in (
        off.choices[0].message.model_extra or {}
    )
