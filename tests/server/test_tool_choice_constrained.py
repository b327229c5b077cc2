"""`tool_choice` required or a named function, on the real tiny model: random weights, yet every reply is a
call whose arguments parse and validate against the tool's schema, because decoding is constrained to it.

The tiny checkpoint here carries a chat template that renders tools (tests/tools_template.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from omnistage.config import engine_config
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server.app import build_app

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 0, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(tiny_tools_checkpoint) -> Iterator[openai.OpenAI]:
    config = engine_config(model=str(tiny_tools_checkpoint), device="cpu", num_kv_pages=64)
    pipeline = AsyncPipeline.from_config(config)
    try:
        http = TestClient(build_app(pipeline, MODEL))
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    finally:
        pipeline.shutdown()


def valid_calls(message) -> list[str]:
    calls = message.tool_calls or []
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in calls]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_always_calls_a_tool_with_valid_arguments(client, seed):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=seed,
        temperature=1.0,
    )
    assert len(valid_calls(reply.choices[0].message)) == 1
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [0, 1])
def test_a_named_function_is_the_one_called(client, seed):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        seed=seed,
    )
    assert valid_calls(reply.choices[0].message) == ["get_time"]


def test_required_streamed_reassembles_to_valid_calls(client):
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        seed=3,
    ) as stream:
        final = stream.get_final_completion()
    assert set(valid_calls(final.choices[0].message)) == {"get_weather"}
