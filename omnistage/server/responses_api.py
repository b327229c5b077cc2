"""`/v1/responses` (OpenAI's Responses API): each request is translated into the chat request it stands for
and answered by chat's own path (chat.py), its answer read into a Response (response_events.py). Responses
are kept for a while (bounded by age and count) so that a later request continues one by
`previous_response_id`, and `GET`/`DELETE /v1/responses/{id}` read or forget one."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from omnistage.errors import InvalidMedia
from omnistage.server.bounded_store import BoundedStore
from omnistage.server.chat import ChatEndpoint
from omnistage.server.errors import InvalidField, NotFound, field_path
from omnistage.server.protocol.chat import ChatCompletionRequest
from omnistage.server.protocol.responses import ResponsesRequest
from omnistage.server.response_events import ResponseObject, ResponsesFormat
from omnistage.server.streaming import Responder

PATH = "/v1/responses"
DEFAULT_RETENTION_S = 3600
DEFAULT_MAX_RESPONSES = 1000

# The Responses API's name of each chat field a refusal may name.
_FIELDS = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
# The chat messages a request's input does not add: its instructions, and the conversation it continues.
_NOT_INPUT = ("instructions", "previous_response_id")
_MESSAGE = re.compile(r"messages\[(\d+)\]")


@dataclass(frozen=True)
class Turn:
    """A kept response's part of its conversation: the messages its request added (its instructions are
    not carried over, as OpenAI does not) and its answer, as chat messages, after those of `earlier`."""

    earlier: Turn | None
    messages: list[dict[str, Any]]
    answer: dict[str, Any]

    def conversation(self) -> list[dict[str, Any]]:
        turns: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            turns.append(turn)
            turn = turn.earlier
        return [message for t in reversed(turns) for message in (*t.messages, t.answer)]


@dataclass(frozen=True)
class Kept:
    """A finished response: the object GET returns and its conversation. A turn holds the one before it, so
    a conversation outlives the earlier responses' ids (a chain's memory is each turn's once)."""

    response: dict[str, Any]
    turn: Turn


class ResponseStore(BoundedStore[Kept]):
    """The finished responses by id, for `previous_response_id` and GET; each holds its turn's input,
    media included, so a server answering large attachments keeps fewer."""


class ResponsesEndpoint:
    def __init__(self, responder: Responder, chat: ChatEndpoint, store: ResponseStore) -> None:
        self.responder, self.chat, self.store = responder, chat, store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        earlier = self._earlier(body.previous_response_id)
        chat_request, origins = self._chat_request(body, earlier)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            (chat_fmt,), new = await self.chat.prepare(chat_request, response_id)
        except InvalidField as exc:
            raise InvalidField(_responses_param(exc.param or "", origins), exc.reason) from None
        except InvalidMedia as exc:  # it names the chat's part: `messages[2].content[0]: ...`
            raise InvalidMedia(
                _MESSAGE.sub(lambda found: _responses_param(found[0], origins), str(exc))
            ) from None
        messages = [message for path, message in origins if path not in _NOT_INPUT]

        def keep(response: ResponseObject) -> None:
            if body.store is not False:
                self.store.keep(
                    response.id, Kept(response.model_dump(), Turn(earlier, messages, answer_of(response)))
                )

        fmt = ResponsesFormat(chat_fmt, self._shell(body, response_id), keep)
        return await self.responder.respond(request, PATH, fmt, new, bool(body.stream))

    async def retrieve(self, response_id: str) -> JSONResponse:
        kept = self.store.get(response_id)
        if kept is None:
            raise NotFound(self._missing(response_id))
        return JSONResponse(kept.response)

    async def delete(self, response_id: str) -> JSONResponse:
        if self.store.pop(response_id) is None:
            raise NotFound(self._missing(response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _missing(self, response_id: str) -> str:
        return (
            f"no response {response_id!r} is kept: it is unknown, was not stored (store: false), or expired "
            f"(responses are kept {self.store.retention_s} s, at most {self.store.max_kept:,} of them)"
        )

    def _earlier(self, previous_response_id: str | None) -> Turn | None:
        if previous_response_id is None:
            return None
        kept = self.store.get(previous_response_id)
        if kept is None:
            raise InvalidField("previous_response_id", self._missing(previous_response_id))
        return kept.turn

    def _chat_request(
        self, body: ResponsesRequest, earlier: Turn | None
    ) -> tuple[ChatCompletionRequest, list[tuple[str, dict[str, Any]]]]:
        """The chat request `body` stands for, and each of its messages with the field it comes from."""
        origins = (
            [("instructions", {"role": "system", "content": body.instructions})] if body.instructions else []
        )
        history = earlier.conversation() if earlier else ()
        origins += [("previous_response_id", message) for message in history]
        origins += body.chat_messages()
        try:
            chat = ChatCompletionRequest.model_validate(
                {**body.chat_fields(), "messages": [message for _, message in origins]}
            )
        except ValidationError as exc:
            error = exc.errors()[0]
            reason = error["msg"].removeprefix("Value error, ")
            raise InvalidField(_responses_param(field_path(error["loc"]), origins), reason) from None
        return chat, origins

    def _shell(self, body: ResponsesRequest, response_id: str) -> ResponseObject:
        """The Response as it starts, with the fields of its request that OpenAI echoes."""
        tool_choice: Any = body.tool_choice or "auto"
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            model=self.responder.served_model_name,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            temperature=body.temperature,
            top_p=body.top_p,
            text={"format": (body.text.format.model_dump(by_alias=True, exclude_none=True))}
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}},
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            truncation=body.truncation or "disabled",
            user=body.user,
        )


def answer_of(response: ResponseObject) -> dict[str, Any]:
    """A response's output as the chat's assistant message: its text and its tool calls."""
    text = "".join(part.text for item in response.output if item.type == "message" for part in item.content)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if item.type == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _responses_param(chat_param: str, origins: list[tuple[str, dict[str, Any]]]) -> str:
    """The Responses API's field for a chat field: `messages[3].content` names the input item that message
    came from (`input[1].content`), or the instructions, or the conversation it continues."""
    found = _MESSAGE.match(chat_param)
    if found is None:
        head, dot, rest = chat_param.partition(".")
        return _FIELDS.get(head, head) + dot + rest
    index = int(found[1])
    origin = origins[index][0] if index < len(origins) else "input"
    return origin if origin in _NOT_INPUT else origin + chat_param[found.end() :]
