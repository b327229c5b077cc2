"""Qwen's `<tool_call>` text parsed into OpenAI's tool calls, whole and streamed, and the forced-call constraint."""

from __future__ import annotations

import json

import pytest

from omnistage.request import StructuredOutput, ToolSchema
from omnistage.server.errors import InvalidField
from omnistage.server.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    parse_tool_calls,
    tool_constraint,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_one_call_becomes_a_tool_call_and_no_content():
    content, calls = parse_tool_calls(WEATHER)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > len("call_")


def test_parallel_calls_keep_their_order_and_unique_ids():
    content, calls = parse_tool_calls("Let me check.\n" + WEATHER + "\n" + TIME)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',
        "</tool_call><tool_call>",
        '<tool_call>["name"]</tool_call> tail',
    ],
)
def test_malformed_call_text_stays_content_as_written(text):
    assert parse_tool_calls(text) == (text, [])


def test_string_arguments_are_read_as_json_text():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(calls[0].arguments) == {"a": 1}


@pytest.mark.parametrize(
    "arguments",
    [
        '{"city": "Paris", "days": 2}',
        '{ "city":"Par\\u00eds" ,"days" :2 }',
        '{"char":"\\ud800","low":"\\udc00x","pair":"\\ud83d\\ude00"}',
        '{"a": {"nested": ["\\ud800", "}"]}, "a b": "\\"arguments\\": 1"}',
        "{}",
    ],
)
def test_arguments_are_the_text_the_model_wrote(arguments):
    """Not its value spelled again: a value may hold a lone surrogate, which no response can encode as UTF-8."""
    for body in (
        f'{{"name": "f", "arguments": {arguments}}}',
        f'\n {{ "arguments" :\t{arguments} , "name":"f"}} \n',
    ):
        _, [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert call.arguments == arguments
        call.arguments.encode()


def test_a_repeated_arguments_key_is_its_last_as_json_reads_it():
    _, [call] = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>'
    )
    assert call.arguments == '{"b": 2}'


def test_string_arguments_holding_a_lone_surrogate_keep_it_escaped():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\", \\"b\\": \\"\\ud83d\\ude00\\"}"}</tool_call>'
    _, [call] = parse_tool_calls(text)
    assert call.arguments == '{"a": "\\ud800", "b": "\U0001f600"}'
    assert json.loads(call.arguments) == {"a": "\ud800", "b": "\U0001f600"}


def test_a_name_holding_a_lone_surrogate_is_no_call():
    text = '<tool_call>{"name": "f\\udfff", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])
    assert all(isinstance(e, ContentDelta) for e in stream(text, 4))


def stream(text: str, piece: int) -> list:
    parser = ToolCallStream()
    events = []
    for i in range(0, len(text), piece):
        events += parser.feed(text[i : i + piece])
    return events + parser.finish()


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_events_reassemble_to_the_whole_parse(piece):
    text = "Sure <b>.\n" + WEATHER + "\n" + TIME + " done <tool_"
    events = stream(text, piece)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, CallStart)]
    arguments = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            arguments[e.index] = arguments.get(e.index, "") + e.text
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "get_time")]
    assert [json.loads(arguments[i]) for i in (0, 1)] == [json.loads(c.arguments) for c in whole_calls]
    # a call's name comes before its arguments
    assert events.index(starts[0]) < next(i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta))


def test_streamed_content_is_not_held_longer_than_a_possible_tag():
    parser = ToolCallStream()
    assert parser.feed("Hello <") == [ContentDelta("Hello ")]
    assert parser.feed("b>") == [ContentDelta("<b>")]


@pytest.mark.parametrize("piece", [1, 5])
def test_streamed_unclosed_or_malformed_call_comes_back_as_content(piece):
    text = '<tool_call>\nnope\n</tool_call> and <tool_call>{"name": "f"'
    events = stream(text, piece)
    assert all(isinstance(e, ContentDelta) for e in events)
    assert "".join(e.text for e in events) == text


TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time"},
]


def test_auto_and_none_leave_decoding_free():
    assert tool_constraint(TOOLS, "auto", True) is None
    assert tool_constraint(TOOLS, "none", True) is None


def test_required_constrains_to_every_tool_with_its_schema():
    constraint = tool_constraint(TOOLS, "required", False)
    assert constraint == StructuredOutput(
        tools=(
            ToolSchema("get_weather", json.dumps(TOOLS[0]["parameters"])),
            ToolSchema("get_time", json.dumps({"type": "object"})),
        ),
        parallel_tool_calls=False,
    )


def test_a_named_function_constrains_to_one_call_of_it():
    choice = {"type": "function", "function": {"name": "get_time"}}
    constraint = tool_constraint(TOOLS, choice, True)
    assert constraint is not None
    assert [t.name for t in constraint.tools] == ["get_time"]
    assert constraint.parallel_tool_calls is False


def test_a_named_function_not_among_the_tools_is_a_400_naming_tool_choice():
    with pytest.raises(InvalidField) as caught:
        tool_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    assert caught.value.param == "tool_choice"
