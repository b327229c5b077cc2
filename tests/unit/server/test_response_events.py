"""ResponsesFormat reads a Response and its events off chat's answer: text, and tool calls in the shape
OpenAI's chat streams and returns them, each event and response valid as the openai SDK's types."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from openai_types import strictly

from omnistage.server.formats import ChatFormat, sse
from omnistage.server.response_events import ResponseObject, ResponsesFormat
from omnistage.server.responses import ChatChunkChoice, ChatCompletionChunk, ChatDelta, Usage

ARGUMENTS = ['{"city": ', '"Paris"}']
USAGE = Usage.of(prompt_tokens=11, completion_tokens=7)


class CallingChat(ChatFormat):
    """Chat's answer of some text, then a call of get_weather: streamed as OpenAI streams a chat's tool call
    (its id and name first, then its arguments in pieces), whole as a message's tool_calls."""

    def delta(self, text: str, finish_reason: str | None) -> list[str]:
        if text != "call":
            return super().delta(text, finish_reason)
        first = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
        pieces = [first, *({"index": 0, "function": {"arguments": piece}} for piece in ARGUMENTS)]
        return [self._call_chunk(piece) for piece in pieces]

    def _call_chunk(self, call: dict[str, Any]) -> str:
        chunk = ChatCompletionChunk(
            id=self.id, created=0, model=self.model, choices=[ChatChunkChoice(delta=ChatDelta())]
        )
        data = chunk.model_dump()
        data["choices"][0]["delta"] = {"tool_calls": [call]}
        return sse(data)

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        data = super().response(text, finish_reason, usage)
        function = {"name": "get_weather", "arguments": "".join(ARGUMENTS)}
        data["choices"][0]["message"]["tool_calls"] = [
            {"id": "call_1", "type": "function", "function": function}
        ]
        data["choices"][0]["finish_reason"] = "tool_calls"
        return data


def responses_format(kept: list[ResponseObject]) -> ResponsesFormat:
    shell = ResponseObject(id="resp_1", created_at=0, model="m")
    return ResponsesFormat(CallingChat("resp_1", "m", include_usage=False), shell, kept.append)


def events_of(chunks: list[str]) -> list[Any]:
    events = []
    for chunk in chunks:
        name, data = chunk.removesuffix("\n\n").split("\n")
        event = strictly(ResponseStreamEvent, json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    return events


def test_streamed_text_then_a_call_are_two_items():
    kept: list[ResponseObject] = []
    fmt = responses_format(kept)
    chunks = [*fmt.opening(), *fmt.delta("Let me see.", None), *fmt.delta("call", None)]
    chunks += [*fmt.delta("", "tool_calls"), *fmt.closing("tool_calls"), fmt.usage_chunk(USAGE)]
    events = events_of(chunks)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    message, call = events[-1].response.output
    assert message.type == "message" and message.content[0].text == "Let me see."
    assert call.type == "function_call" and call.call_id == "call_1" and call.name == "get_weather"
    assert call.arguments == events[11].arguments == "".join(ARGUMENTS) and call.status == "completed"
    assert [e.output_index for e in events[8:13]] == [1] * 5 and events[8].item.arguments == ""
    assert events[-1].response.usage.input_tokens == 11 and [r.id for r in kept] == ["resp_1"]


def test_a_whole_answer_with_a_call():
    kept: list[ResponseObject] = []
    body = responses_format(kept).response("Let me see.", "stop", USAGE)
    response = strictly(Response, body)
    message, call = response.output
    assert message.content[0].text == "Let me see." and call.arguments == "".join(ARGUMENTS)
    assert response.status == "completed" and kept[0].model_dump() == body


def test_an_answer_cut_short_is_incomplete():
    kept: list[ResponseObject] = []
    fmt = ResponsesFormat(
        ChatFormat("resp_2", "m", False), ResponseObject(id="resp_2", created_at=0, model="m"), kept.append
    )
    events = events_of([*fmt.opening(), *fmt.delta("Hi", None), *fmt.delta(" there", "length")])
    events += events_of([*fmt.closing("length"), fmt.usage_chunk(USAGE)])
    assert events[-1].type == "response.incomplete" and events[-2].item.status == "incomplete"
    response = events[-1].response
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "Hi there"
    assert response.completed_at is None


def test_nothing_said_is_one_empty_message():
    fmt = ResponsesFormat(
        ChatFormat("resp_3", "m", False), ResponseObject(id="resp_3", created_at=0, model="m"), lambda r: None
    )
    events = events_of([*fmt.opening(), *fmt.delta("", "stop"), *fmt.closing("stop"), fmt.usage_chunk(USAGE)])
    assert events[-1].response.output_text == "" and len(events[-1].response.output) == 1
