"""A forced tool call whose arguments hold the escape of a lone UTF-16 surrogate (`"\\ud800"`), through a live
server on the tiny checkpoint (a chat template that renders tools: tests/tools_template.py): chat, whole and
streamed, the Responses API, whole and streamed, and a realtime session each carry the arguments as the model
wrote them, an ASCII escape, where a str holding the surrogate itself cannot be encoded as UTF-8.

A `pattern` constrains a string's JSON text, escapes and all, so this tool's only call, whatever the weights
draw, is `{"name": "spell", "arguments": {"char":"\\ud800"}}`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from omnistage.config import engine_config
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server.app import build_app
from tests.server.conftest import serving
from tests.server.realtime_client import KEY, connect, in_loop, manual, until

PARAMETERS = {
    "type": "object",
    "properties": {"char": {"type": "string", "pattern": r"^\\ud800$"}},
    "required": ["char"],
    "additionalProperties": False,
}
SPELL = {"name": "spell", "description": "Spell one character.", "parameters": PARAMETERS}
ESCAPE = "\\ud800"  # the six ASCII characters the model writes


@pytest.fixture(scope="module")
def url(tiny_tools_checkpoint) -> Iterator[str]:
    config = engine_config(model=str(tiny_tools_checkpoint), device="cpu", num_kv_pages=64)
    pipeline = AsyncPipeline.from_config(config)
    try:
        with serving(build_app(pipeline, "tiny", api_key=KEY)) as url:
            yield url
    finally:
        pipeline.shutdown()


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def written(arguments: str) -> None:
    """The arguments are the model's text: the escape as written, which decodes to the lone surrogate."""
    assert ESCAPE in arguments, arguments
    assert json.loads(arguments) == {"char": "\ud800"}


def chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Spell it."}],
        tools=[{"type": "function", "function": SPELL}],
        tool_choice={"type": "function", "function": {"name": "spell"}},
        max_tokens=64,
        seed=0,
        **extra,
    )


def test_chat_carries_the_escape_as_written(client):
    reply = chat(client)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "spell"
    written(call.function.arguments)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_chat_streamed_carries_the_escape_as_written(client):
    arguments, finish = "", None
    for chunk in chat(client, stream=True):
        for choice in chunk.choices:
            arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    written(arguments)
    assert finish == "tool_calls"


def respond(client: openai.OpenAI, **extra):
    return client.responses.create(
        model="tiny",
        input="Spell it.",
        tools=[{"type": "function", **SPELL}],
        tool_choice={"type": "function", "name": "spell"},
        max_output_tokens=64,
        **extra,
    )


def test_responses_carry_the_escape_as_written(client):
    [call] = [item for item in respond(client).output if item.type == "function_call"]
    assert call.name == "spell"
    written(call.arguments)


def test_responses_streamed_carry_the_escape_as_written(client):
    events = list(respond(client, stream=True))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    written(done.arguments)
    assert (
        "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        == done.arguments
    )
    assert events[-1].type == "response.completed"


@in_loop
async def test_a_realtime_session_carries_the_escape_as_written(url):
    async with connect(url) as conn:
        tools = [{"type": "function", **SPELL}]
        await manual(
            conn, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64
        )
        question = {"type": "input_text", "text": "Spell it."}
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [question]})
        await conn.response.create(response={"output_modalities": ["text"]})
        events = await until(conn, "response.done")
        [call] = events[-1].response.output
        assert (call.type, call.name, call.status) == ("function_call", "spell", "completed")
        written(call.arguments)
