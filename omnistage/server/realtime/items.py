"""`conversation.item.create`'s item as the conversation holds it: user audio decoded from the session's input
format to the 16 kHz clip the audio encoder reads, each part checked against its message's role."""

from __future__ import annotations

import binascii

import pybase64

from omnistage.server.realtime import protocol
from omnistage.server.realtime.codecs import AudioFormat, to_model_rate
from omnistage.server.realtime.conversation import Item, Part, new_id


class BadItem(ValueError):
    """An item the conversation cannot hold; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def item_of(
    given: protocol.MessageItem | protocol.FunctionCallItem | protocol.FunctionCallOutputItem,
    input_format: AudioFormat,
) -> Item:
    """The conversation's item for a client's; raises BadItem."""
    item_id = given.id or new_id("item")
    if isinstance(given, protocol.FunctionCallItem):
        call_id = given.call_id or new_id("call")
        return Item(item_id, "function_call", name=given.name, arguments=given.arguments, call_id=call_id)
    if isinstance(given, protocol.FunctionCallOutputItem):
        return Item(item_id, "function_call_output", call_id=given.call_id, output=given.output)
    parts = [part_of(given.role, part, i, input_format) for i, part in enumerate(given.content)]
    return Item(item_id, "message", given.role, parts)


def part_of(role: str, given: protocol.ContentPart, index: int, input_format: AudioFormat) -> Part:
    where = f"item.content[{index}]"
    if role in ("user", "system") and given.type == "input_text" and given.text is not None:
        return Part("input_text", given.text)
    if role == "user" and given.type == "input_audio" and given.audio is not None:
        try:
            samples = input_format.decode(pybase64.b64decode(given.audio, validate=True))
        except (binascii.Error, ValueError):
            raise BadItem(
                f"{where}.audio: not base64 audio of the session's input format", f"{where}.audio"
            ) from None
        return Part("input_audio", given.transcript or "", clip=to_model_rate(samples, input_format.rate))
    if role == "assistant" and given.type in ("output_text", "text") and given.text is not None:
        return Part("output_text", given.text)
    if role == "assistant" and given.type in ("output_audio", "audio"):
        return Part("output_audio", given.transcript or "")
    raise BadItem(
        f"{where}: a {role} message holds no {given.type!r} part (or it lacks its text or audio)",
        f"{where}.type",
    )
