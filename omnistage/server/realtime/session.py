"""One realtime session over its WebSocket: the client's events handled in order, the server's sent through
one lock, its conversation, and its one response (or a transcription session's transcriptions) as tasks
beside the reading loop. The input audio buffer and the turns server VAD finds in it are `input_buffer.py`'s.

A bad event is answered with an `error` event and the session goes on; a session ends when its client closes
or goes away, or when it is idle too long, and then every task it started is cancelled, which aborts their
requests in the pipeline and frees their pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.websockets import WebSocket

from omnistage.errors import InvalidRequest
from omnistage.server.realtime import protocol
from omnistage.server.realtime.conversation import (
    Conversation,
    Item,
    Part,
    UnknownItem,
    new_id,
)
from omnistage.server.realtime.input_buffer import InputBuffer
from omnistage.server.realtime.items import BadItem, item_of
from omnistage.server.realtime.link import Link, Services
from omnistage.server.realtime.protocol import SessionError
from omnistage.server.realtime.settings import Settings
from omnistage.server.realtime.transcription import Transcriber
from omnistage.server.realtime.turns import Response

log = logging.getLogger(__name__)


class Session:
    def __init__(self, websocket: WebSocket, settings: Settings, services: Services) -> None:
        self.websocket, self.settings = websocket, settings
        self.conversation = Conversation()
        self.link = Link(
            services.pipeline,
            services.voices,
            services.metrics,
            self.send,
            self.conversation,
            services.max_conversation_tokens,
        )
        self.id = new_id("sess")
        self.input = InputBuffer(self.link, self)
        self.response: Response | None = None
        self.responding: asyncio.Task | None = None
        self.transcribing: set[asyncio.Task] = set()
        self.closed = False
        self._sending = asyncio.Lock()

    # -- sending ------------------------------------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        """Send one server event; once the client is gone nothing more is sent (the reading loop ends)."""
        if self.closed:
            return
        text = json.dumps({"event_id": new_id("event"), **event}, ensure_ascii=False)
        try:
            async with self._sending:
                await self.websocket.send_text(text)
        except Exception:  # the client went away mid-send: the reading loop sees the disconnect
            self.closed = True

    async def error(
        self, message: str, code: str | None, param: str | None = None, event_id: str | None = None
    ) -> None:
        error = {
            "type": "invalid_request_error",
            "code": code,
            "message": message,
            "param": param,
            "event_id": event_id,
        }
        await self.send({"type": "error", "error": error})

    async def opened(self) -> None:
        self.input.detect(self.settings)
        await self.send({"type": "session.created", "session": self.session_body()})

    def session_body(self) -> dict[str, Any]:
        return {"id": self.id, **self.settings.as_dict()}

    # -- receiving ----------------------------------------------------------------------------------------

    async def handle(self, frame: str | bytes) -> None:
        """One frame from the client: its event carried out, or an `error` event saying why not."""
        try:
            event = protocol.parse_event(frame)
        except protocol.BadEvent as exc:
            await self.error(str(exc), exc.code, exc.param, exc.event_id)
            return
        try:
            await self._dispatch(event)
        except SessionError as exc:
            await self.error(str(exc), exc.code, exc.param, event.event_id)
        except InvalidRequest as exc:
            await self.error(str(exc), "invalid_value", getattr(exc, "param", None), event.event_id)
        except Exception:  # this event alone fails; the session goes on
            log.exception("realtime session %s failed on a %s event", self.id, event.type)
            error = {"type": "server_error", "code": "internal_error", "event_id": event.event_id}
            message = "the server failed this event (an internal error, logged)"
            await self.send({"type": "error", "error": {**error, "message": message, "param": None}})

    async def _dispatch(self, event: protocol.ClientEvent) -> None:
        if isinstance(event, protocol.SessionUpdate):
            await self._update(event.session)
        elif isinstance(event, protocol.BufferAppend):
            await self.input.append(event.audio, self.settings, self.conversation)
        elif isinstance(event, protocol.BufferCommit):
            await self.commit()
        elif isinstance(event, protocol.BufferClear):
            self.input.clear()
            await self.send({"type": "input_audio_buffer.cleared"})
        elif isinstance(event, protocol.ItemCreate):
            await self._create_item(event.item, event.previous_item_id)
        elif isinstance(event, protocol.ItemDelete):
            await self._delete_item(event.item_id)
        elif isinstance(event, protocol.ItemRetrieve):
            await self.send(
                {"type": "conversation.item.retrieved", "item": self._item(event.item_id).as_dict()}
            )
        elif isinstance(event, protocol.ItemTruncate):
            await self._truncate(event)
        elif isinstance(event, protocol.ResponseCreate):
            self._respond(event.response)
        elif isinstance(event, protocol.ResponseCancel):
            await self._cancel_asked(event.response_id)

    async def _update(self, given: protocol.SessionConfig) -> None:
        voices, before = self.link.voices, self.settings
        self.settings = self.settings.updated(given, voices, bool(voices.speakers))
        if self.settings.input_format != before.input_format and self.input.buffered:
            self.settings = before
            raise SessionError(
                "session.audio.input.format: the input audio buffer holds audio of the old format; commit or "
                "clear it first",
                "invalid_value",
                "session.audio.input.format",
            )
        detecting = (self.settings.turn_detection, self.settings.input_format)
        if detecting != (before.turn_detection, before.input_format):
            self.input.detect(self.settings)
        await self.send({"type": "session.updated", "session": self.session_body()})

    # -- the user's turns ------------------------------------------------------------------------------------

    async def interrupt(self) -> None:
        await self.cancel("turn_detected")

    async def end_turn(self, respond: bool) -> None:
        await self.commit()
        if respond and self.settings.kind == "realtime" and not self._responding():
            self._respond(None)

    async def commit(self) -> None:
        """The buffer becomes the user's audio item (a transcription session transcribes it)."""
        item_id, clip = self.input.take(self.settings)
        item = Item(item_id, "message", "user", [Part("input_audio", clip=clip)])
        previous = self.conversation.add(item)
        await self.send(
            {"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous}
        )
        await self._item_added(item, previous)
        if self.settings.kind == "transcription" or self.settings.transcribe_input:
            task = asyncio.ensure_future(Transcriber(self.link, self.settings, item).run())
            self.transcribing.add(task)
            task.add_done_callback(self.transcribing.discard)

    # -- the conversation ---------------------------------------------------------------------------------

    def _item(self, item_id: str) -> Item:
        try:
            return self.conversation.find(item_id)
        except UnknownItem:
            raise SessionError(
                f"item_id: the conversation holds no item {item_id!r}", "item_not_found", "item_id"
            ) from None

    async def _item_added(self, item: Item, previous: str | None) -> None:
        body = item.as_dict()
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": body})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": body})

    async def _create_item(
        self,
        given: protocol.MessageItem | protocol.FunctionCallItem | protocol.FunctionCallOutputItem,
        previous_item_id: str | None,
    ) -> None:
        try:
            item = item_of(given, self.settings.input_format)
        except BadItem as exc:
            raise SessionError(str(exc), "invalid_value", exc.param) from None
        if previous_item_id is not None:
            self._item(previous_item_id)
        try:
            previous = self.conversation.add(item, previous_item_id)
        except ValueError as exc:
            raise SessionError(f"item.id: {exc}", "invalid_value", "item.id") from None
        await self._item_added(item, previous)

    async def _delete_item(self, item_id: str) -> None:
        self._item(item_id)
        if self.response is not None and self.responding is not None and not self.responding.done():
            if any(item.id == item_id for item in self.response.output):
                raise SessionError(
                    "item_id: the item is being written by the response in progress",
                    "invalid_value",
                    "item_id",
                )
        self.conversation.delete(item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def _truncate(self, event: protocol.ItemTruncate) -> None:
        item = self._item(event.item_id)
        if (
            item.role != "assistant"
            or event.content_index >= len(item.parts)
            or item.parts[event.content_index].type != "output_audio"
        ):
            raise SessionError(
                "item_id: only an assistant message's audio can be truncated", "invalid_value", "item_id"
            )
        if self.response is not None and item in self.response.output:
            await self.cancel("client_cancelled")
        part = item.parts[event.content_index]
        if event.audio_end_ms > part.audio_ms:
            raise SessionError(
                f"audio_end_ms: {event.audio_end_ms} ms is past the end of the item's audio ({part.audio_ms} ms)",
                "invalid_value",
                "audio_end_ms",
            )
        part.truncate(event.audio_end_ms, self.link.pipeline.frontend.processor.decode)
        item.status = "incomplete"
        await self.send(
            {
                "type": "conversation.item.truncated",
                "item_id": item.id,
                "content_index": event.content_index,
                "audio_end_ms": event.audio_end_ms,
            }
        )

    # -- responses ----------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._responding() or bool(self.transcribing)

    def _responding(self) -> bool:
        return self.responding is not None and not self.responding.done()

    def _respond(self, overrides: protocol.ResponseParams | None) -> None:
        if self.settings.kind == "transcription":
            raise SessionError("a transcription session makes no responses", "invalid_value", "type")
        if self.responding is not None and not self.responding.done():
            raise SessionError(
                f"the conversation already has an active response ({self.response.id if self.response else ''})",
                "conversation_already_has_active_response",
            )
        voices = self.link.voices
        settings = self.settings.for_response(overrides, voices, bool(voices.speakers))
        self.response = Response(self.link, settings, self.input.speech_ended)
        self.responding = asyncio.ensure_future(self.response.run())

    async def _cancel_asked(self, response_id: str | None) -> None:
        active = self.response if self.responding is not None and not self.responding.done() else None
        if active is None:
            raise SessionError("there is no active response to cancel", "response_cancel_not_active")
        if response_id is not None and response_id != active.id:
            raise SessionError(
                f"response_id: {response_id!r} is not the active response ({active.id})",
                "invalid_value",
                "response_id",
            )
        await self.cancel("client_cancelled")

    async def cancel(self, reason: str) -> None:
        """Cut the active response short (its pages freed), and wait for its `response.done`."""
        task, response = self.responding, self.response
        if task is None or task.done() or response is None:
            return
        response.cancel_reason = reason
        self.link.metrics.realtime_barge_ins.inc()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """The session ends: everything it started is cancelled (their requests aborted, pages freed)."""
        self.closed = True
        await self.input.close()
        tasks = [*self.transcribing, *([self.responding] if self.responding is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
