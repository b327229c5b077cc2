"""The Responses API's answer: the Response object and the server-sent events that stream it, read off a
chat's answer (its message, or its chunks as ChatFormat spells them), so that whatever chat writes (text,
tool calls) reaches a Response as its output items."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from omnistage.outputs import TokenLogprobs
from omnistage.server.formats import ChatFormat
from omnistage.server.responses import Usage


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prefix-cache hits are not reported per request
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    """A Response; the fields of its request that OpenAI echoes are echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    completed_at: int | None = None
    model: str
    output: list[MessageItem | FunctionCallItem] = []
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    background: bool = False


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


Status = Literal["in_progress", "completed", "incomplete"]


@dataclass
class _Text:
    """A message item as it is written; `status` is set once it is done."""

    id: str
    pieces: list[str] = field(default_factory=list)
    status: Status | None = None

    def item(self) -> MessageItem:
        if self.status is None:
            return MessageItem(id=self.id, status="in_progress", content=[])
        return MessageItem(id=self.id, status=self.status, content=[OutputText(text="".join(self.pieces))])


@dataclass
class _Call:
    """A function call item as it is written; `status` is set once it is done."""

    id: str
    call_id: str
    name: str
    pieces: list[str] = field(default_factory=list)
    status: Status | None = None

    def item(self) -> FunctionCallItem:
        arguments = "".join(self.pieces) if self.status is not None else ""
        status = self.status or "in_progress"
        return FunctionCallItem(
            id=self.id, status=status, call_id=self.call_id, name=self.name, arguments=arguments
        )


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    """A Response and its events, read off the chat's answer that `chat` spells; `keep(response)` is called
    with the finished Response (for previous_response_id and GET).

    Streamed: response.created and .in_progress, then for each output item .output_item.added, its content
    (a message's .content_part.added, .output_text.delta ... .done, .content_part.done; a function call's
    .function_call_arguments.delta ... .done), .output_item.done, and last .completed (or .incomplete when
    max_output_tokens cut it), every event with its sequence_number.
    """

    include_usage = True  # the closing event carries the usage
    done = ""  # the stream ends with response.completed (or .incomplete), as OpenAI's does
    continuous_usage = False
    running_usage: Usage | None = None

    def __init__(
        self, chat: ChatFormat, shell: ResponseObject, keep: Callable[[ResponseObject], None]
    ) -> None:
        self.chat, self.shell, self.keep = chat, shell, keep
        self.id = shell.id
        self._sequence = 0
        self._items: list[_Text | _Call] = []
        self._calls: dict[int, _Call] = {}  # by the chat's tool-call index
        self._finish: str | None = None

    def opening(self) -> list[str]:
        shell = self.shell.model_dump()
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        """`logprobs`: none, as the request cannot ask for them (protocol/responses.py)."""
        return self._read(self.chat.delta(text, finish_reason))

    def closing(self, finish_reason: str) -> list[str]:
        events = self._read(self.chat.closing(finish_reason))
        self._finish = self._finish or finish_reason
        if not self._items:  # nothing said: one empty message, as a reply always has
            events += self._text("")
        return events + self._close_open(self._status())

    def usage_chunk(self, usage: Usage) -> str:
        response = self._finished(usage)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return self._event(kind, response=response.model_dump())

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        choice = self.chat.response(text, finish_reason, usage)["choices"][0]
        message, self._finish = choice["message"], choice["finish_reason"]
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            self._items.append(_Text(_id("msg"), [message.get("content") or ""]))
        for call in calls:
            function = call["function"]
            self._items.append(_Call(_id("fc"), call["id"], function["name"], [function["arguments"]]))
        for item in self._items:
            item.status = "completed"
        self._items[-1].status = self._status()  # what a cut ends is the last item
        return self._finished(usage).model_dump()

    def _status(self) -> Literal["completed", "incomplete"]:
        return "incomplete" if self._finish == "length" else "completed"

    def _finished(self, usage: Usage) -> ResponseObject:
        """The whole Response, kept."""
        cut = self._finish == "length"
        response = self.shell.model_copy(
            update={
                "status": self._status(),
                "completed_at": None if cut else int(time.time()),
                "output": [item.item() for item in self._items],
                "incomplete_details": IncompleteDetails() if cut else None,
                "usage": ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens,
                ),
            }
        )
        self.keep(response)
        return response

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _sse(event)

    def _read(self, chunks: list[str]) -> list[str]:
        """The events of the chat's chunks (each `data: {...}`): its text and its tool calls."""
        events: list[str] = []
        for chunk in chunks:
            for choice in json.loads(chunk.removeprefix("data: "))["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    events += self._text(delta["content"])
                for call in delta.get("tool_calls") or ():
                    events += self._call(call)
                self._finish = choice.get("finish_reason") or self._finish
        return events

    def _text(self, text: str) -> list[str]:
        events: list[str] = []
        last = self._items[-1] if self._items else None
        if not isinstance(last, _Text) or last.status is not None:
            events += self._close_open("completed")
            last = _Text(_id("msg"))
            self._items.append(last)
            index = len(self._items) - 1
            events.append(
                self._event("response.output_item.added", output_index=index, item=last.item().model_dump())
            )
            part = OutputText(text="").model_dump()
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=last.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        if text:
            last.pieces.append(text)
            at = {"item_id": last.id, "output_index": len(self._items) - 1, "content_index": 0}
            events.append(self._event("response.output_text.delta", **at, delta=text, logprobs=[]))
        return events

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = delta.get("function") or {}
        call = self._calls.get(delta["index"])
        if call is None:
            events += self._close_open("completed")
            call = _Call(_id("fc"), delta.get("id") or _id("call"), function.get("name", ""))
            self._calls[delta["index"]] = call
            self._items.append(call)
            item = call.item().model_dump()
            events.append(
                self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)
            )
        if arguments := function.get("arguments"):
            call.pieces.append(arguments)
            index = self._items.index(call)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=index,
                    delta=arguments,
                )
            )
        return events

    def _close_open(self, status: Status) -> list[str]:
        """The events that end the item still being written, if any, as `status`."""
        last = self._items[-1] if self._items else None
        if last is None or last.status is not None:
            return []
        last.status = status
        index, done = len(self._items) - 1, last.item().model_dump()
        at = {"item_id": last.id, "output_index": index}
        if isinstance(last, _Text):
            part = done["content"][0]
            events = [
                self._event(
                    "response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]
                ),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        else:
            events = [self._event("response.function_call_arguments.done", **at, arguments=done["arguments"])]
        return [*events, self._event("response.output_item.done", output_index=index, item=done)]
