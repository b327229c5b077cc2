"""A session's conversation as the chat template reads it, and an answer cut to what was heard."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.server.realtime.conversation import Conversation, Item, Part, UnknownItem, truncated_transcript


def test_messages_in_the_chat_shape():
    conversation = Conversation()
    clip = np.zeros(1_600, np.float32)
    conversation.add(
        Item("u1", "message", "user", [Part("input_audio", clip=clip), Part("input_text", "hm")])
    )
    conversation.add(Item("a1", "message", "assistant", [Part("output_audio", "It is sunny.")]))
    conversation.add(Item("c1", "function_call", name="f", arguments="{}", call_id="call_1"))
    conversation.add(Item("c2", "function_call", name="g", arguments="{}", call_id="call_2"))
    conversation.add(Item("o1", "function_call_output", call_id="call_1", output="1"))
    assert conversation.add(Item("s1", "message", "system", [Part("input_text", "Be kind.")]), "u1") == "u1"
    messages, has_audio = conversation.messages("Be brief.")
    assert has_audio
    assert [m["role"] for m in messages] == ["system", "user", "system", "assistant", "assistant", "tool"]
    assert messages[1]["content"][0]["audio"] is clip and messages[1]["content"][1] == {
        "type": "text",
        "text": "hm",
    }
    assert messages[3] == {"role": "assistant", "content": "It is sunny."}
    assert [call["function"]["name"] for call in messages[4]["tool_calls"]] == [
        "f",
        "g",
    ]  # one turn, two calls
    assert messages[5] == {"role": "tool", "content": "1", "tool_call_id": "call_1"}
    conversation.delete("s1")
    with pytest.raises(UnknownItem):
        conversation.find("s1")
    with pytest.raises(ValueError):
        conversation.add(Item("u1", "message", "user", []))


@pytest.mark.parametrize(
    ("heard_ms", "total_ms", "kept"),
    [
        (0, 1_000, ""),
        (600, 1_000, "The quick brown"),  # 60% of the characters end inside "fox": back to the word before
        (1_000, 1_000, "The quick brown fox jumps over"),
        (2_000, 1_000, "The quick brown fox jumps over"),
    ],
)
def test_truncated_transcript(heard_ms, total_ms, kept):
    assert truncated_transcript("The quick brown fox jumps over", heard_ms, total_ms) == kept
