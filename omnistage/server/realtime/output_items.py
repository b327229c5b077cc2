"""A response's output as the client and the conversation see it: its items (a message, function calls), each
added to the conversation and announced as it opens, its text, audio and call arguments streamed as OpenAI's
delta events, and every item closed with its done events when the response ends, however it ends."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from omnistage.outputs import AUDIO_SAMPLE_RATE, RequestOutput, SpokenFrame
from omnistage.server.realtime.codecs import AudioEncoder
from omnistage.server.realtime.conversation import Item, Part, new_id
from omnistage.server.realtime.link import Link
from omnistage.server.realtime.settings import Settings
from omnistage.server.tool_calls import ArgumentsDelta, CallStart, ContentDelta, StreamEvent


class OutputItems:
    """The output items of response `response_id`, in order (`items`). `speech_ended`: when the user's turn
    ended, from which the first audio's latency is measured."""

    def __init__(self, response_id: str, link: Link, settings: Settings, speech_ended: float | None) -> None:
        self.response_id, self.link, self.settings = response_id, link, settings
        self.speech_ended = speech_ended
        self.items: list[Item] = []
        self.held = ""  # a spoken reply's content while it may still call tools
        # the reply's text tokens (and, spoken, its frames) so far, its message part's from when it opens (the
        # same lists): the next turn's prompt takes the tokens as they were sampled (Processor.encode_chat)
        self.spoken_ids: list[int] = []
        self._spoken_frames: list[SpokenFrame] = []
        self._first_audio_sent = False
        self._encoders: dict[str, AudioEncoder] = {}  # by item id: each spoken item's

    async def open(self, item: Item) -> None:
        previous = self.link.conversation.add(item)
        self.items.append(item)
        index = len(self.items) - 1
        body = item.as_dict()
        await self.link.send(
            {
                "type": "response.output_item.added",
                "response_id": self.response_id,
                "output_index": index,
                "item": body,
            }
        )
        await self.link.send({"type": "conversation.item.added", "previous_item_id": previous, "item": body})

    def _where(self, item: Item) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": item.id, "output_index": self.items.index(item)}

    async def message(self, spoken: bool) -> Item:
        """The response's message item, opened (with its one content part) on first use."""
        for item in self.items:
            if item.type == "message":
                return item
        part = Part("output_text", token_ids=self.spoken_ids)
        if spoken:
            part = Part("output_audio", token_ids=self.spoken_ids, frames=self._spoken_frames)
        item = Item(new_id("item"), "message", "assistant", [part], status="in_progress")
        await self.open(item)
        shown = {"type": "audio", "transcript": ""} if spoken else {"type": "text", "text": ""}
        event = {
            "type": "response.content_part.added",
            **self._where(item),
            "content_index": 0,
            "part": shown,
        }
        await self.link.send(event)
        if spoken:
            self._encoders[item.id] = AudioEncoder(self.settings.output_format)
        return item

    async def message_delta(self, delta: str, output: RequestOutput | None) -> None:
        spoken = self.settings.spoken
        if output is not None:
            self.spoken_ids += output.outputs[0].delta_token_ids
            self._spoken_frames += output.spoken_frames
        if not delta and (output is None or output.audio_delta is None or not len(output.audio_delta)):
            return
        item = await self.message(spoken)
        part, where = item.parts[0], self._where(item)
        if delta:
            part.text += delta
            kind = "response.output_audio_transcript.delta" if spoken else "response.output_text.delta"
            await self.link.send({"type": kind, **where, "content_index": 0, "delta": delta})
        if output is not None and output.audio_delta is not None and len(output.audio_delta):
            pcm = output.audio_delta
            data = self._encoders[item.id](pcm)
            part.audio_ms += len(pcm) * 1000 // AUDIO_SAMPLE_RATE
            if data:
                encoded = base64.b64encode(data).decode("ascii")
                await self.link.send(
                    {"type": "response.output_audio.delta", **where, "content_index": 0, "delta": encoded}
                )
                self._first_audio(output.metrics)

    def _first_audio(self, times: dict[str, float]) -> None:
        """The first audio delta was sent: its latency from the end of speech, and where that went (`times`:
        the output's marks)."""
        if self._first_audio_sent:
            return
        self._first_audio_sent = True
        if self.speech_ended is not None:
            sent = time.monotonic()
            self.link.metrics.realtime_first_audio.observe(sent - self.speech_ended)
            self.link.metrics.realtime_turn(self.speech_ended, times, sent)

    async def call_events(self, events: list[StreamEvent]) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                if self.settings.spoken:  # spoken once the reply is whole (see turns.py)
                    self.held += event.text
                else:
                    await self.message_delta(event.text, None)
            elif isinstance(event, CallStart):
                item = Item(
                    new_id("item"), "function_call", name=event.name, call_id=event.id, status="in_progress"
                )
                await self.open(item)
            elif isinstance(event, ArgumentsDelta):
                item = [item for item in self.items if item.type == "function_call"][event.index]
                item.arguments += event.text
                await self.link.send(
                    {
                        "type": "response.function_call_arguments.delta",
                        **self._where(item),
                        "call_id": item.call_id,
                        "delta": event.text,
                    }
                )

    async def close(self, status: str) -> None:
        """Every item still open, done (`incomplete` where the reply was cut short)."""
        send = self.link.send
        for item in self.items:
            if item.status != "in_progress":
                continue
            item.status = status  # type: ignore[assignment]
            where = self._where(item)
            if item.type == "function_call":
                await send(
                    {
                        "type": "response.function_call_arguments.done",
                        **where,
                        "call_id": item.call_id,
                        "name": item.name,
                        "arguments": item.arguments,
                    }
                )
            else:
                part = item.parts[0]
                if part.type == "output_audio":
                    tail = self._encoders[item.id](np.zeros(0, np.float32), last=True)
                    if tail:
                        await send(
                            {
                                "type": "response.output_audio.delta",
                                **where,
                                "content_index": 0,
                                "delta": base64.b64encode(tail).decode("ascii"),
                            }
                        )
                    await send({"type": "response.output_audio.done", **where, "content_index": 0})
                    await send(
                        {
                            "type": "response.output_audio_transcript.done",
                            **where,
                            "content_index": 0,
                            "transcript": part.text,
                        }
                    )
                    shown = {"type": "audio", "transcript": part.text}
                else:
                    await send(
                        {"type": "response.output_text.done", **where, "content_index": 0, "text": part.text}
                    )
                    shown = {"type": "text", "text": part.text}
                await send({"type": "response.content_part.done", **where, "content_index": 0, "part": shown})
            body = item.as_dict()
            await send(
                {
                    "type": "response.output_item.done",
                    "response_id": self.response_id,
                    "output_index": where["output_index"],
                    "item": body,
                }
            )
            await send({"type": "conversation.item.done", "item": body})
