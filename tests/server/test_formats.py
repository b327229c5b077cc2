"""The stream chunks of formats.py: a token's chunk, spelled from a template, reads byte for byte as the
models spell it."""

from __future__ import annotations

import json
import random

import pytest

from omnistage.server.formats import ChatFormat, CompletionFormat
from omnistage.server.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from omnistage.server.speech import SpokenChatFormat
from omnistage.server.spoken_answers import SpokenAnswers

_random = random.Random(0)
TEXTS = [
    " hello",
    "a",
    'say "hi"',
    "back\\slash \\n \\u0041 \\",
    "line\nbreak\r\n\ttab",
    "".join(map(chr, range(0x20))) + "\x7f",  # every control char JSON escapes, and DEL, which it does not
    "\u2028\u2029",  # JSON leaves them as they are; JavaScript's string literals do not
    "café naïve Straße",
    "中文，日本語のテキスト、한국어",
    "🙂👍🏽👩‍👩‍👧‍👦 🇫🇷",
    "</script><b>&amp;</b>",
    "<text>",  # the marker the template is split at
    '"<text>"',
    "{},[]:null",
    " ",
    "".join(map(chr, range(0x80))),
    *("".join(chr(_random.randrange(1, 0xD800)) for _ in range(12)) for _ in range(50)),
    *("".join(chr(_random.randrange(0x10000, 0x110000)) for _ in range(4)) for _ in range(20)),
]
IDS = [
    ("chatcmpl-0123456789abcdef", "Qwen/Qwen3-Omni-30B-A3B-Instruct"),
    ('id "<text>"', 'model \\ "<text>" ü'),  # escapes before the text, too
    ("<text>", "<text>"),  # the marker's JSON string before the text
]


def _sse(chunk: ChatCompletionChunk | CompletionResponse, include_usage: bool) -> str:
    payload = chunk.model_dump(exclude=None if include_usage else {"usage"})
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chat_reference(fmt: ChatFormat, text: str) -> str:
    choice = ChatChunkChoice(delta=ChatDelta(content=text))
    chunk = ChatCompletionChunk(id=fmt.id, created=fmt.created, model=fmt.model, choices=[choice])
    return _sse(chunk, fmt.include_usage)


def completion_reference(fmt: CompletionFormat, text: str, finish_reason: str | None) -> str:
    choice = CompletionChoice(text=text, finish_reason=finish_reason)
    chunk = CompletionResponse(id=fmt.id, created=fmt.created, model=fmt.model, choices=[choice])
    return _sse(chunk, fmt.include_usage)


@pytest.mark.parametrize("request_id, model", IDS)
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_delta_reads_as_the_models_spell_it(request_id: str, model: str, include_usage: bool) -> None:
    fmt = ChatFormat(request_id, model, include_usage)
    for text in TEXTS:
        assert fmt.delta(text, None) == [chat_reference(fmt, text)], repr(text)
        # The finish reason rides on the closing chunk, never on a text delta.
        assert fmt.delta(text, "stop") == [chat_reference(fmt, text)], repr(text)
    assert fmt.delta("", None) == []


@pytest.mark.parametrize("request_id, model", IDS)
@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_delta_reads_as_the_models_spell_it(
    request_id: str, model: str, include_usage: bool
) -> None:
    fmt = CompletionFormat(request_id, model, include_usage)
    for text in TEXTS:
        assert fmt.delta(text, None) == [completion_reference(fmt, text, None)], repr(text)
        assert fmt.delta(text, "length") == [completion_reference(fmt, text, "length")], repr(text)
    assert fmt.delta("", None) == []
    assert fmt.delta("", "stop") == [completion_reference(fmt, "", "stop")]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_delta_parses_back_to_its_text(include_usage: bool) -> None:
    chat = ChatFormat("chatcmpl-1", "m", include_usage)
    completion = CompletionFormat("cmpl-1", "m", include_usage)
    for text in TEXTS:
        [chat_chunk], [completion_chunk] = chat.delta(text, None), completion.delta(text, None)
        assert chat_chunk.startswith("data: ") and chat_chunk.endswith("\n\n")
        assert json.loads(chat_chunk[6:])["choices"][0]["delta"] == {"content": text}
        assert json.loads(completion_chunk[6:])["choices"][0]["text"] == text
        assert ("usage" in json.loads(chat_chunk[6:])) is include_usage


def test_spoken_delta_carries_the_transcript() -> None:
    fmt = SpokenChatFormat(
        "chatcmpl-1", "m", include_usage=False, audio_format="wav", answers=SpokenAnswers()
    )
    [first] = fmt.delta('a "quote"', None)
    assert json.loads(first[6:])["choices"][0]["delta"] == {
        "audio": {"id": fmt.audio_id, "transcript": 'a "quote"'}
    }
    [second] = fmt.delta("é🙂", None)
    assert json.loads(second[6:])["choices"][0]["delta"] == {"audio": {"transcript": "é🙂"}}
