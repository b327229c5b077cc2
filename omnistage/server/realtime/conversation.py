"""A session's conversation: its items in order, as the client and the server events see them, and as the chat
template reads them.

User audio is kept as the 16 kHz clip the audio encoder reads; an assistant's spoken answer as its transcript,
the length of its audio, and (where the server spoke it) its text tokens with the codec frames made from them,
so that a truncate keeps the text the user heard. Every turn renders the whole conversation again
(instructions, earlier user audio and text, the assistant's answers, function calls and their outputs), so that
what the model reads is exactly the conversation the client holds, after any delete or truncate.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from omnistage.outputs import AUDIO_SAMPLE_RATE, SpokenFrame
from omnistage.server.realtime.codecs import MODEL_RATE

Role = Literal["user", "assistant", "system"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


@dataclass
class Part:
    """One piece of a message: text (`input_text`, `output_text`) or audio (`input_audio` with its 16 kHz
    clip, `output_audio` with the milliseconds of it the client has, its transcript in `text`, and where the
    server spoke it, the reply's text tokens and its frames as their audio went out)."""

    type: Literal["input_text", "input_audio", "output_text", "output_audio"]
    text: str = ""
    clip: np.ndarray | None = None
    audio_ms: int = 0
    token_ids: list[int] = field(default_factory=list)
    frames: list[SpokenFrame] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text}
        return {"type": self.type, "transcript": self.text or None}

    def truncate(self, audio_end_ms: int, decode: Callable[[list[int]], str]) -> None:
        """Spoken audio cut at `audio_end_ms`: its transcript becomes the text tokens the Talker had read by the
        last frame played whole (`decode`d), what the user heard. Audio the server did not speak (an item the
        client made) keeps its transcript: nothing says which of its words were heard."""
        if self.token_ids:
            played = audio_end_ms * AUDIO_SAMPLE_RATE // 1000
            self.frames = [frame for frame in self.frames if frame.audio_end <= played]
            self.token_ids = self.token_ids[: self.frames[-1].text_tokens if self.frames else 0]
            self.text = decode(self.token_ids)
        self.audio_ms = audio_end_ms


@dataclass
class Item:
    """A message, a function call or a function call's output (OpenAI's conversation item)."""

    id: str
    type: Literal["message", "function_call", "function_call_output"]
    role: Role | None = None
    parts: list[Part] = field(default_factory=list)
    name: str = ""
    arguments: str = ""
    call_id: str = ""
    output: str = ""
    status: Literal["completed", "incomplete", "in_progress"] = "completed"

    def as_dict(self) -> dict[str, Any]:
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "message":
            return base | {"role": self.role, "content": [part.as_dict() for part in self.parts]}
        if self.type == "function_call":
            return base | {"name": self.name, "arguments": self.arguments, "call_id": self.call_id}
        return base | {"call_id": self.call_id, "output": self.output}

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.parts)


class UnknownItem(KeyError):
    """An item id the conversation does not hold."""


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert `item` after `previous_item_id` (at the end when None); the id of the item before it."""
        if any(held.id == item.id for held in self.items):
            raise ValueError(f"the conversation already holds an item {item.id!r}")
        at = len(self.items) if previous_item_id is None else self.index(previous_item_id) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def index(self, item_id: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise UnknownItem(item_id)

    def find(self, item_id: str) -> Item:
        return self.items[self.index(item_id)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id)]

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def messages(self, instructions: str) -> tuple[list[dict[str, Any]], bool]:
        """The conversation as chat messages (user audio decoded, as the processor takes it), and whether any
        holds audio."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        has_audio = False
        for item in self.items:
            if item.type == "function_call":
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
            elif item.role == "user" and any(part.clip is not None for part in item.parts):
                has_audio = True
                content = [
                    {"type": "audio", "audio": part.clip}
                    if part.clip is not None
                    else {"type": "text", "text": part.text}
                    for part in item.parts
                ]
                messages.append({"role": "user", "content": content})
            else:
                message: dict[str, Any] = {"role": item.role, "content": item.text}
                if item.role == "assistant" and len(item.parts) == 1 and item.parts[0].token_ids:
                    message["token_ids"] = item.parts[
                        0
                    ].token_ids  # its reply as sampled, where they spell it
                messages.append(message)
        return messages, has_audio

    def audio_seconds(self) -> float:
        return sum(
            len(part.clip) / MODEL_RATE for item in self.items for part in item.parts if part.clip is not None
        )
