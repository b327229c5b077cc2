"""The Responses API's request as the chat request it stands for: input items as chat messages, refusals
named by the Responses API's fields, and a kept conversation read back in order."""

from __future__ import annotations

from omnistage.server.protocol.responses import ResponsesRequest
from omnistage.server.responses_api import Turn, _responses_param


def call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def test_calls_in_a_row_join_the_assistant_message_before_them():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        call("a"),
        call("b"),
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "2"}]},
        call("c"),
    ]
    messages = ResponsesRequest.model_validate({"model": "m", "input": items}).chat_messages()
    assert [path for path, _ in messages] == ["input[0]", "input[1]", "input[4]", "input[5]", "input[6]"]
    user, assistant, first, second, alone = (message for _, message in messages)
    assert user == {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    assert assistant["content"] == "Let me see." and [c["id"] for c in assistant["tool_calls"]] == ["a", "b"]
    assert first == {"role": "tool", "tool_call_id": "a", "content": "1"} and second["content"] == "2"
    assert alone["content"] == "" and alone["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_chat_fields_are_named_as_the_responses_api_names_them():
    origins = [("instructions", {}), ("previous_response_id", {}), ("input[0]", {}), ("input[2]", {})]
    assert _responses_param("messages[3].content[0].text", origins) == "input[2].content[0].text"
    assert _responses_param("messages[1].content", origins) == "previous_response_id"
    assert _responses_param("messages[0]", origins) == "instructions"
    assert _responses_param("messages", origins) == "input"
    assert _responses_param("max_completion_tokens", origins) == "max_output_tokens"
    assert _responses_param("response_format.json_schema", origins) == "text.format.json_schema"
    assert _responses_param("temperature", origins) == "temperature"


def test_a_conversation_reads_its_turns_in_order():
    first = Turn(None, [{"role": "user", "content": "1"}], {"role": "assistant", "content": "2"})
    second = Turn(first, [{"role": "user", "content": "3"}], {"role": "assistant", "content": "4"})
    assert [m["content"] for m in second.conversation()] == ["1", "2", "3", "4"]
