"""A Thinking model's reply split into its reasoning and its answer, as OpenAI-compatible servers return it.

Qwen3's Thinking checkpoints reason inside `<think> ... </think>` before answering; the chat response carries
the reasoning as `message.reasoning_content` (streamed as `delta.reasoning_content`) and the answer after
`</think>` as `content`. Where the reply starts is read off the prompt: a template that opens the assistant
turn with `<think>` itself has the reply start inside the block, with no opening tag of its own; otherwise
the reply reasons only when it opens the block (with `enable_thinking` false the template closes an empty
block in the prompt, and the reply is all answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

OPEN, CLOSE = "<think>", "</think>"
AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


def chosen_parser(choice: str, model_path: Path) -> str | None:
    """The parser a server runs: the one chosen, or with `auto` qwen3 for a Qwen3-Omni checkpoint without a
    Talker (`enable_audio_output` false, or no `talker_config`: the Thinking and Captioner ones; a reply that
    opens no think block, as the Captioner's, is all content) and none otherwise."""
    if choice != AUTO:
        return None if choice == NONE else choice
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    speaks = config.get("enable_audio_output", config.get("talker_config") is not None)
    thinker_only = config.get("model_type") == "qwen3_omni_moe" and speaks is False
    return "qwen3" if thinker_only else None


def opens_thinking(prompt: str) -> bool:
    """Whether the prompt leaves the reply inside a think block (the template opened it)."""
    return prompt.rstrip().endswith(OPEN)


def split(text: str, inside: bool) -> Split:
    """A whole reply's reasoning and answer; `inside`: the reply starts inside the think block."""
    splitter = StreamSplitter(inside)
    first, last = splitter.feed(text), splitter.finish()
    return Split(first.reasoning + last.reasoning, first.content + last.content)


class StreamSplitter:
    """Splits a reply streamed in pieces. A piece may end inside a tag, so the characters that could still
    become one are held until the next piece (or the end) says what they are."""

    def __init__(self, inside: bool) -> None:
        self._state = "reasoning" if inside else "start"  # start -> reasoning -> answer, or start -> answer
        self._held = ""

    def feed(self, piece: str) -> Split:
        if self._state == "answer":
            return Split(content=piece)
        text, self._held = self._held + piece, ""
        if self._state == "start":
            stripped = text.lstrip()
            if OPEN.startswith(stripped):  # nothing yet, or part of the opening tag
                self._held = text
                return Split()
            if not stripped.startswith(OPEN):
                self._state = "answer"
                return Split(content=text)
            self._state, text = "reasoning", stripped.removeprefix(OPEN)
        head, closed, tail = text.partition(CLOSE)
        if closed:
            self._state = "answer"
            return Split(head, tail)
        keep = _partial_tag(head)
        self._held = head[len(head) - keep :]
        return Split(reasoning=head[: len(head) - keep])

    def finish(self) -> Split:
        """What is held when the reply ends: a partial tag was text after all."""
        held, self._held = self._held, ""
        return Split(reasoning=held) if self._state == "reasoning" else Split(content=held)


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` begin `</think>` (0 when none)."""
    for size in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-size:]):
            return size
    return 0
