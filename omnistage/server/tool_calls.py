"""Qwen's tool calls in the model's text, as OpenAI's `tool_calls`, and the constraint a forced call decodes under.

Qwen3 models call a function by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. The
text between calls stays the reply's content; a call whose body is not such an object (random weights write
anything) stays content too, exactly as written, so nothing the model emits can fail the request.

Streamed, a call is held back from its opening tag to its closing one and then sent as OpenAI sends it: a first
delta with its index, id and name, then its arguments as a delta of their own. Text that could still become an
opening tag is held until it cannot.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from omnistage.request import StructuredOutput, ToolSchema
from omnistage.server.errors import InvalidField

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_DECODER = json.JSONDecoder()
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text as the model wrote it, as OpenAI's `function.arguments`
    carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_call(body: str) -> tuple[str, str] | None:
    """The (name, arguments JSON) of one call's body, or None where it is not `{"name": str, "arguments": obj}`.

    The arguments are the text the model wrote, not their value spelled again: what it produced byte for byte,
    and always sendable, where the value may hold a lone UTF-16 surrogate (JSON lets a string write `\\ud800`)
    that no response, stream or websocket can encode as UTF-8. A name holding one is no tool's: no call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    if _SURROGATE.search(call["name"]):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some fine-tunes write the arguments already as JSON text
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        # A surrogate the outer string's escape gave sits inside one of the text's strings: escaped, it reads
        # the same.
        text = _SURROGATE.sub(lambda lone: f"\\u{ord(lone[0]):04x}", arguments)
    else:
        value, text = arguments, _member_texts(body).get("arguments", "{}")
    return (call["name"], text) if isinstance(value, dict) else None


def _member_texts(body: str) -> dict[str, str]:
    """The members of `body`, a JSON object of one member or more that json.loads accepted: each key's value as
    written (a repeated key's last, the one json.loads keeps)."""
    texts: dict[str, str] = {}
    at = _past_space(body, 0)  # the opening brace
    while body[at] != "}":  # at the brace or the comma before a member
        key, at = _DECODER.raw_decode(body, _past_space(body, at + 1))
        start = _past_space(body, _past_space(body, at) + 1)  # past the colon
        _, at = _DECODER.raw_decode(body, start)
        texts[key] = body[start:at]
        at = _past_space(body, at)
    return texts


def _past_space(text: str, at: int) -> int:
    """Where JSON's whitespace from `at` on ends."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The reply's content (the text outside well-formed calls) and its calls, in order."""
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while (start := rest.find(OPEN)) >= 0:
        end = rest.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        parsed = parse_call(rest[start + len(OPEN) : end])
        if parsed is None:
            content.append(rest[: end + len(CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(ToolCall(new_call_id(), *parsed))
        rest = rest[end + len(CLOSE) :]
    content.append(rest)
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def _held_prefix(text: str) -> int:
    """How many characters at the end of `text` could begin an opening tag."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Turns the reply's text, fed piece by piece, into content deltas and OpenAI-shaped call deltas."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                events.extend(self._call(body))
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _held_prefix(self._buffer)
                ready, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                if ready:
                    events.append(ContentDelta(ready))
                return events
            if start:
                events.append(ContentDelta(self._buffer[:start]))
            self._buffer = self._buffer[start + len(OPEN) :]
            self._in_call = True

    def finish(self) -> list[StreamEvent]:
        """What is still held once the reply ends: an unclosed call, or a partial tag, goes out as content."""
        held = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return [ContentDelta(held)] if held else []

    def _call(self, body: str) -> list[StreamEvent]:
        parsed = parse_call(body)
        if parsed is None:
            return [ContentDelta(OPEN + body + CLOSE)]
        name, arguments = parsed
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, new_call_id(), name), ArgumentsDelta(index, arguments)]


def tool_constraint(
    tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
) -> StructuredOutput | None:
    """The constraint a request's tool choice puts on decoding: calls of the tools `required` allows (or of the
    one named) with arguments valid against their schemas; None where the model chooses freely (`auto`,
    `none`). `tools` are the request's function definitions (`{"name", "parameters"?, "strict"?}`)."""
    by_name = {tool["name"]: tool for tool in tools}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in by_name:
            raise InvalidField("tool_choice", f"names {name!r}, which is not among the request's tools")
        chosen = [by_name[name]]
        parallel_tool_calls = False
    elif tool_choice == "required":
        chosen = list(tools)
    else:
        return None
    schemas = tuple(
        ToolSchema(tool["name"], json.dumps(tool.get("parameters") or {"type": "object"})) for tool in chosen
    )
    return StructuredOutput(tools=schemas, parallel_tool_calls=parallel_tool_calls)
