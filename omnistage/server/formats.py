"""How each endpoint spells its stream chunks and its whole response, in OpenAI's shapes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring
from typing import Any, Protocol, runtime_checkable

import numpy as np
from fastapi.responses import Response

from omnistage.outputs import TokenLogprobs
from omnistage.server.logprobs import CompletionLogprobsWriter, TokenTexts, chat_logprobs
from omnistage.server.reasoning import StreamSplitter, split
from omnistage.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from omnistage.server.tool_calls import (
    CallStart,
    ContentDelta,
    StreamEvent,
    ToolCallStream,
    parse_tool_calls,
)

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _text_chunks(render: Callable[[str], str], spliced: bool = True) -> Callable[[str], str]:
    """The chunk `render` spells for a text, spelled by splicing the text into it (`spliced`; else `render`
    itself, for chunks that differ in more than their text: each with the usage so far).

    A token's chunk differs from the next one only in its text, so it is spelled once per stream from the
    models, split around a marker text's JSON string, and each token encodes its text alone (0.11 against
    9.7 us a token). The split is at the last occurrence: only fixed fields follow the text, while the id and
    model before it are anyone's strings. encode_basestring is how json.dumps(ensure_ascii=False) spells a
    str, without its 0.6 us of setup.
    """
    if not spliced:
        return render
    marker = "<text>"
    head, _, tail = render(marker).rpartition(encode_basestring(marker))
    return lambda text: f"{head}{encode_basestring(text)}{tail}"


class Format(Protocol):
    """How one endpoint spells its stream chunks and its whole response. `logprobs`: those of the delta's
    tokens, or of the whole reply's (None where the request asked for none). With `continuous_usage` (vLLM's
    `continuous_usage_stats`) every chunk carries `running_usage`, which the caller sets before each."""

    id: str
    include_usage: bool
    done: str  # what ends a stream: OpenAI's `data: [DONE]`, or nothing where its last event says it
    continuous_usage: bool
    running_usage: Usage | None

    def opening(self) -> list[str]: ...
    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]: ...
    def closing(self, finish_reason: str) -> list[str]: ...
    def usage_chunk(self, usage: Usage) -> str: ...
    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any] | Response: ...


@runtime_checkable
class SpeakingFormat(Format, Protocol):
    """A Format whose reply is spoken too: stream chunks for each piece of audio and for the encoder's last
    bytes (encoding runs in worker threads, hence awaited), `release` of the encoder however the stream ended,
    and the whole response with the whole audio (run in a worker thread)."""

    async def audio(self, pcm: np.ndarray) -> list[str]: ...
    async def audio_end(self) -> list[str]: ...
    def release(self) -> None: ...
    def spoken_response(
        self, text: str, finish_reason: str, usage: Usage, audio: np.ndarray
    ) -> dict[str, Any] | Response: ...


class ChoiceStream:
    """What every endpoint's format holds of its one choice: the response's id, model and creation time, its
    `index` among the request's choices, and whether the usage goes out (`include_usage`, once at the end;
    `continuous_usage`, `running_usage` on every chunk)."""

    done = DONE

    def __init__(
        self, request_id: str, model: str, include_usage: bool, index: int, continuous_usage: bool
    ) -> None:
        self.id, self.model, self.include_usage = request_id, model, include_usage
        self.index, self.continuous_usage = index, continuous_usage
        self.running_usage: Usage | None = None
        self.created = int(time.time())


class ChatFormat(ChoiceStream):
    """Chat's chunks and response of one choice (its `index`); `fingerprint` is their `system_fingerprint`,
    and `prompt_audio_tokens` (set once the prompt is laid out) goes into the usage's prompt details. With
    `texts` (the request asked for logprobs), each chunk carries its tokens' logprobs, and a token without text
    still has its chunk."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        fingerprint: str | None = None,
        texts: TokenTexts | None = None,
        *,
        index: int = 0,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(request_id, model, include_usage, index, continuous_usage)
        self.fingerprint, self.texts = fingerprint, texts
        self.prompt_audio_tokens = 0
        self._text_chunk = self._delta_chunks(lambda text: ChatDelta(content=text))

    def _delta_chunks(self, delta: Callable[[str], ChatDelta]) -> Callable[[str], str]:
        """The chunk of this choice with a text in its `delta`."""

        def render(text: str) -> str:
            return self._chunk([self._choice(delta(text))])

        return _text_chunks(render, spliced=not self.continuous_usage)

    def _choice(
        self,
        delta: ChatDelta,
        logprobs: ChatChoiceLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> ChatChunkChoice:
        return ChatChunkChoice(index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        if usage is None and self.running_usage is not None:
            usage = self.running_usage.with_prompt_audio(self.prompt_audio_tokens)
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=usage,
        )
        return sse(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))

    def opening(self) -> list[str]:
        return [self._chunk([self._choice(ChatDelta(role="assistant", content=""))])]

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        if self.texts is not None and logprobs:
            choice = self._choice(ChatDelta(content=text), chat_logprobs(self.texts, logprobs))
            return [self._chunk([choice])]
        return [self._text_chunk(text)] if text else []

    def closing(self, finish_reason: str) -> list[str]:
        return [self._chunk([self._choice(ChatDelta(), finish_reason=finish_reason)])]

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage.with_prompt_audio(self.prompt_audio_tokens))

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        return self.whole(AssistantMessage(content=text), finish_reason, usage, logprobs)

    def whole(
        self,
        message: AssistantMessage,
        finish_reason: str,
        usage: Usage,
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> dict[str, Any]:
        """The whole response of one choice."""
        given = (
            chat_logprobs(self.texts, logprobs) if self.texts is not None and logprobs is not None else None
        )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[
                ChatChoice(index=self.index, message=message, logprobs=given, finish_reason=finish_reason)
            ],
            usage=usage.with_prompt_audio(self.prompt_audio_tokens),
        ).model_dump()


class ReasoningChatFormat(ChatFormat):
    """Chat's chunks and response for a reply that reasons first: its think block goes to
    `reasoning_content`, the answer after it to `content` (reasoning.py). `inside`: the prompt left the reply
    inside the block."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        fingerprint: str | None,
        inside: bool,
        *,
        index: int = 0,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(
            request_id, model, include_usage, fingerprint, index=index, continuous_usage=continuous_usage
        )
        self.inside = inside
        self._splitter = StreamSplitter(inside)
        self._reasoning_chunk = self._delta_chunks(lambda text: ChatDelta(reasoning_content=text))

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        """`logprobs`: none, as chat refuses them beside a reasoning parser (chat.py)."""
        parts = [self._splitter.feed(text)]
        if finish_reason is not None:
            parts.append(self._splitter.finish())
        chunks = []
        for part in parts:
            if part.reasoning:
                chunks.append(self._reasoning_chunk(part.reasoning))
            if part.content:
                chunks.append(self._text_chunk(part.content))
        return chunks

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        reply = split(text, self.inside)
        message = AssistantMessage(content=reply.content, reasoning_content=reply.reasoning or None)
        return self.whole(message, finish_reason, usage)


class CompletionFormat(ChoiceStream):
    """Text completions' chunks and response of one choice (its `index`). `echo`: the prompt's text, put before
    the reply (streamed, in the first chunk); `writer`: where the request asked for logprobs, what spells
    them."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        echo: str = "",
        writer: CompletionLogprobsWriter | None = None,
        *,
        index: int = 0,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(request_id, model, include_usage, index, continuous_usage)
        self.echo, self.writer = echo, writer
        self._text_chunk = _text_chunks(
            lambda text: self._chunk([CompletionChoice(index=index, text=text)]), spliced=not continuous_usage
        )

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        usage = usage if usage is not None else self.running_usage
        chunk = CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return sse(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))

    def opening(self) -> list[str]:
        return []

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        text, self.echo = self.echo + text, ""
        written = self.writer.write(logprobs) if self.writer is not None and logprobs else None
        if finish_reason is None and written is None:
            return [self._text_chunk(text)] if text else []
        # OpenAI puts finish_reason on the chunk with the last text, which may be empty.
        choice = CompletionChoice(index=self.index, text=text, logprobs=written, finish_reason=finish_reason)
        return [self._chunk([choice])]

    def closing(self, finish_reason: str) -> list[str]:
        return []

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        written = self.writer.write(logprobs) if self.writer is not None and logprobs is not None else None
        choice = CompletionChoice(
            index=self.index, text=self.echo + text, logprobs=written, finish_reason=finish_reason
        )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        ).model_dump()


class ToolChatFormat(ChatFormat):
    """Chat's chunks and response where the reply may call the request's tools: `<tool_call>` text becomes
    `tool_calls` (streamed as OpenAI streams them, server/tool_calls.py) and a reply that calls ends with
    finish_reason "tool_calls"."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        fingerprint: str | None = None,
        *,
        index: int = 0,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(
            request_id, model, include_usage, fingerprint, index=index, continuous_usage=continuous_usage
        )
        self._calls = ToolCallStream()

    def _events(self, events: list[StreamEvent]) -> list[str]:
        chunks = []
        for event in events:
            if isinstance(event, ContentDelta):
                chunks.append(self._text_chunk(event.text))
                continue
            if isinstance(event, CallStart):
                call = {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            else:
                call = {"index": event.index, "function": {"arguments": event.text}}
            chunks.append(self._chunk([self._choice(ChatDelta(tool_calls=[call]))]))
        return chunks

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        """`logprobs`: none, as chat refuses them beside tools (chat.py)."""
        return self._events(self._calls.feed(text)) if text else []

    def closing(self, finish_reason: str) -> list[str]:
        held = self._events(self._calls.finish())
        return held + super().closing(_finish_reason(finish_reason, self._calls.calls > 0))

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        content, calls = parse_tool_calls(text)
        if not calls:
            return super().response(text, finish_reason, usage)
        message = AssistantMessage(
            content=content or None,
            tool_calls=[
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        )
        return self.whole(message, _finish_reason(finish_reason, True), usage)


def _finish_reason(reason: str, called: bool) -> str:
    # A reply that ends on its own after calling a tool waits for the calls' results (OpenAI's "tool_calls");
    # one cut by max_tokens stays "length".
    return "tool_calls" if called and reason == "stop" else reason
