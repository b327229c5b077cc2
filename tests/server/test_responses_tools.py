"""The Responses API's function tools and `text.format` through the openai SDK against a live `omnistage
serve` (tiny checkpoint, CPU): they ride on chat's tools and constrained decoding, so a required or named
tool is called with arguments that parse, a call's output continues the conversation (by
previous_response_id, or sent back as input items as the Agents SDK does), and a json_schema format gives
JSON that validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.responses import ResponseStreamEvent
from openai_types import strictly
from test_openai_client_responses import FORCED, create

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(launch_server, tiny_tools_checkpoint):
    model = str(tiny_tools_checkpoint)  # a chat template that renders tools (tests/tools_template.py)
    with launch_server("responses-tools-server", "--num-kv-pages", "64", "--model", model) as server:
        yield server


@pytest.fixture(scope="module")
def model(tiny_tools_checkpoint) -> str:
    return tiny_tools_checkpoint.name


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_required_tool_is_called_and_its_output_continues(client, model, tool_choice):
    asked = create(
        client, model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice=tool_choice,
        max_output_tokens=128, temperature=0,
    )  # fmt: skip
    [call] = calls_of(asked)
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    answered = create(
        client, model=model, input=[output], previous_response_id=asked.id, tools=[WEATHER],
        max_output_tokens=2, extra_body=FORCED,
    )  # fmt: skip
    # the prompt holds the first turn, its call (re-rendered by the template, which may spell its JSON more
    # tightly than the model did) and the call's output in a tool response
    arguments = len(call.arguments) // 4  # at least a token per four characters
    assert answered.usage.input_tokens > asked.usage.input_tokens + arguments + len("Sunny, 21 C.") // 4


def test_a_calls_history_as_input_items_is_chats_tool_messages(client, model):
    """The Agents SDK sends the whole history each turn: a function_call item and its output render as
    chat's assistant tool_calls and tool message."""
    arguments = json.dumps({"city": "Paris"})
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    response = create(client, model=model, input=items, tools=[WEATHER], max_output_tokens=1)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    chat = client.chat.completions.create(model=model, messages=messages, tools=[chat_tool], max_tokens=1)
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_call_arrives_as_argument_deltas(client, model):
    events = [
        strictly(ResponseStreamEvent, event.to_dict())
        for event in client.responses.create(
            model=model,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=128,
            temperature=0,
            stream=True,
        )  # fmt: skip
    ]
    [added] = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = calls_of(events[-1].response)
    assert added.item.name == call.name == "get_weather" and done.item_id == added.item.id == call.id
    assert "".join(deltas) == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_json_schema_format_gives_json_that_validates(client, model):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = create(
        client, model=model, input="A person, as JSON.", max_output_tokens=128, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
