"""A session's conversation as the chat template reads it, and a spoken answer cut to what was heard."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.outputs import SpokenFrame
from omnistage.server.realtime.conversation import Conversation, Item, Part, UnknownItem


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


# a reply of four text tokens spoken in ten frames of 1,920 samples, the first 555 short (the decoder's
# look-ahead), frame k made having read min(k + 1, 4) tokens: frames end at 56.9, 136.9, 216.9, ... ms
FRAMES = [SpokenFrame(1_920 * (k + 1) - 555, min(k + 1, 4)) for k in range(10)]


def words(ids: list[int]) -> str:
    return " ".join(["The", "quick", "brown", "fox"][i - 10] for i in ids)


@pytest.mark.parametrize(
    ("heard_ms", "kept"),
    [
        (0, ""),
        (56, ""),  # frame 0 ends at sample 1,365: 56 ms holds 1,344
        (57, "The"),
        (216, "The quick"),
        (217, "The quick brown"),
        (800, "The quick brown fox"),
    ],
)
def test_truncate_keeps_the_text_of_the_frames_heard(heard_ms, kept):
    part = Part(
        "output_audio", "The quick brown fox", audio_ms=800, token_ids=[10, 11, 12, 13], frames=FRAMES
    )
    part.truncate(heard_ms, words)
    assert (part.text, part.audio_ms) == (kept, heard_ms)
    assert words(part.token_ids) == kept and all(f.audio_end <= heard_ms * 24 for f in part.frames)
    part.truncate(heard_ms, words)  # again at the same point: nothing more is cut
    assert part.text == kept


def test_truncate_keeps_the_transcript_of_audio_the_server_did_not_speak():
    part = Part("output_audio", "Said by the client.")
    part.truncate(0, words)
    assert part.text == "Said by the client."
