"""One response of a realtime session: the conversation rendered through the chat template and run through the
pipeline, its text, audio and function calls handed to its output items (`output_items.py`), which stream
them as OpenAI's response events.

A response is a task of its session. Cancelling it (the client's `response.cancel`, or the user speaking over
it) closes its pipeline stream, which aborts the request in every stage and frees its pages; the response then
ends with `response.done` whose status is `cancelled`. A reply that may call tools and is to be spoken is
written first, then its content (what is not a call) spoken: the Talker cannot unsay a call it began to speak.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from omnistage.outputs import RequestOutput
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams, talker_sampling_defaults
from omnistage.server.chat import check_constraint
from omnistage.server.errors import InvalidField, kind_of
from omnistage.server.realtime.conversation import Item, new_id
from omnistage.server.realtime.link import Link
from omnistage.server.realtime.output_items import OutputItems
from omnistage.server.realtime.settings import Settings
from omnistage.server.streaming import raise_if_failed, typed_failure
from omnistage.server.tool_calls import ToolCallStream, tool_constraint


def lay_out(
    processor: Any, context: int, messages: list[dict[str, Any]], has_audio: bool, tools: list[Any] | None
) -> tuple[str, list[int], Any, Any]:
    """The conversation's prompt as the chat template renders it: its text, token ids, and (with audio) its
    M-RoPE positions and media inputs."""
    if has_audio:
        laid_out = processor.process_chat(messages, True, context, False, {}, tools)
        return laid_out.prompt, laid_out.token_ids, laid_out.mrope, laid_out.mm
    prompt, ids = processor.encode_chat(messages, True, context, {}, tools)
    return prompt, ids, None, None


class ConversationTooLong(InvalidField):
    """The conversation renders to more tokens than a session may hold."""

    code = "context_length_exceeded"  # OpenAI's code for a prompt past the context


class Response:
    """One response: `run` streams it; `cancel_reason` set before its task is cancelled says why."""

    def __init__(self, link: Link, settings: Settings, speech_ended: float | None) -> None:
        self.link, self.settings = link, settings
        self.id = new_id("resp")
        self.out = OutputItems(self.id, link, settings, speech_ended)
        self.cancel_reason = "client_cancelled"
        self.usage: dict[str, Any] | None = None
        self.request_id: str | None = None

    @property
    def output(self) -> list[Item]:
        return self.out.items

    def body(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        fmt, voice = self.settings.output_format.as_dict(), self.settings.voice
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [item.as_dict() for item in self.output],
            "output_modalities": list(self.settings.modalities),
            "audio": {"output": {"format": fmt, "voice": voice}},
            "max_output_tokens": self.settings.max_output_tokens or "inf",
            "metadata": self.settings.metadata or None,
            "conversation_id": None,
            "usage": self.usage,
        }

    async def run(self) -> str:
        """Stream the response to its end; its status (completed, cancelled, incomplete or failed)."""
        send = self.link.send
        await send({"type": "response.created", "response": self.body("in_progress")})
        status, details = "completed", cast(dict[str, Any] | None, None)
        try:
            await self._generate()
            if any(item.status == "incomplete" for item in self.output):
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status, details = "cancelled", {"type": "cancelled", "reason": self.cancel_reason}
            await self.out.close("incomplete")
        except Exception as exc:
            failure = typed_failure(exc, self.id)
            kind = kind_of(failure)
            code = getattr(failure, "code", None) or kind.code
            error = {"type": kind.type, "code": code, "message": str(failure)}
            await send({"type": "error", "error": {**error, "param": getattr(failure, "param", None)}})
            status, details = "failed", {"type": "failed", "error": error}
            await self.out.close("incomplete")
        await send({"type": "response.done", "response": self.body(status, details)})
        self.link.metrics.realtime_responses.labels(status).inc()
        return status

    # -- the request --------------------------------------------------------------------------------------

    def _calling(self) -> bool:
        """Whether the reply may call the session's tools (they reach the template whenever there are any)."""
        settings, processor = self.settings, self.link.pipeline.frontend.processor
        if not settings.tools:
            return False
        if not getattr(processor, "renders_tools", False):
            raise InvalidField("session.tools", "this checkpoint's chat template does not render tools")
        return settings.tool_choice != "none"

    def _request(self, messages: list[dict[str, Any]], has_audio: bool, calling: bool) -> GenerationRequest:
        """The conversation laid out by the processor (in a worker thread: tokenizing and the audio's features
        let go of the GIL)."""
        settings, frontend = self.settings, self.link.pipeline.frontend
        processor, context = frontend.processor, frontend.max_model_len
        tools = list(settings.tools) or None
        params = SamplingParams(max_tokens=settings.max_output_tokens)
        if calling:
            functions = [tool["function"] for tool in settings.tools]
            choice = settings.tool_choice
            params.structured = tool_constraint(functions, choice, settings.parallel_tool_calls)
            if params.structured is not None:
                check_constraint(params.structured)
        prompt, ids, mrope, mm = lay_out(processor, context, messages, has_audio, tools)
        if len(ids) > self.link.max_conversation_tokens:
            raise ConversationTooLong(
                "conversation",
                f"the conversation is {len(ids):,} tokens; a session holds at most "
                f"{self.link.max_conversation_tokens:,} (delete items to go on)",
            )
        speech = None
        if settings.spoken and not calling:
            voice = self.link.voices.speaker(settings.voice, "session.audio.output.voice")
            speech = SpeechParams(voice=voice, talker=talker_sampling_defaults())
        self.request_id = new_id("rt")
        return GenerationRequest(self.request_id, ids, params, prompt, mrope, mm, speech)

    async def _generate(self) -> None:
        calling = self._calling()
        messages, has_audio = self.link.conversation.messages(self.settings.instructions)
        new = await asyncio.to_thread(self._request, messages, has_audio, calling)
        audio_tokens = sum(getattr(new.mm, "num_audio_tokens", None) or ())
        last = await self._stream(new, calling)
        usage = last.outputs[0] if last is not None else None
        self._usage(len(new.prompt_token_ids), audio_tokens, usage.token_ids if usage else [], last)
        if calling and self.settings.spoken:
            await self._speak_content()

    async def _stream(self, new: GenerationRequest, calling: bool) -> RequestOutput | None:
        outputs = self.link.pipeline.generate(new)
        calls, last = ToolCallStream() if calling else None, None
        try:
            async for output in outputs:
                last = output
                if output.finished:
                    raise_if_failed(output)
                delta = output.outputs[0].delta_text
                if calls is None:
                    await self.out.message_delta(delta, output)
                else:
                    await self.out.call_events(calls.feed(delta))
            if calls is not None:
                await self.out.call_events(calls.finish())
            if last is not None and last.outputs[0].finish_reason == "length":
                await self.out.close("incomplete")
            else:
                await self.out.close("completed")
        finally:
            await outputs.aclose()
            self._counted(last)
        return last

    async def _speak_content(self) -> None:
        """A written reply's content, spoken (its function calls are items of their own)."""
        text = self.out.held.strip()
        if not text:
            return
        frontend = self.link.pipeline.frontend
        tts = await asyncio.to_thread(frontend.tts_prompt, text)
        voice = self.link.voices.speaker(self.settings.voice, "session.audio.output.voice")
        speech = SpeechParams(
            voice=voice, talker=talker_sampling_defaults(), reply_token_ids=tts.reply_token_ids
        )
        params = SamplingParams(max_tokens=max(1, len(tts.reply_token_ids)))
        new = GenerationRequest(new_id("rt"), tts.token_ids, params, tts.prompt, speech=speech)
        self.request_id = new.request_id
        self.out.spoken_ids += tts.reply_token_ids  # the outputs carry none: the reply is given
        await self.out.message_delta(text, None)
        outputs, last = self.link.pipeline.generate(new), None
        try:
            async for output in outputs:
                last = output
                if output.finished:
                    raise_if_failed(output)
                await self.out.message_delta("", output)
            await self.out.close("completed")
        finally:
            await outputs.aclose()
            self._counted(last)

    def _counted(self, last: RequestOutput | None) -> None:
        """A request of the response has ended (or was cut off): its tokens and latencies in /metrics, as an
        HTTP request's."""
        if last is not None:
            self.link.metrics.observe(last)

    def _usage(
        self, prompt_tokens: int, audio_tokens: int, generated: list[int], last: RequestOutput | None
    ) -> None:
        frames = last.num_audio_frames if last is not None else 0
        output_tokens = len(generated) + frames
        self.usage = {
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "input_token_details": {
                "text_tokens": prompt_tokens - audio_tokens,
                "audio_tokens": audio_tokens,
                "image_tokens": 0,
                "cached_tokens": 0,
            },
            "output_token_details": {"text_tokens": len(generated), "audio_tokens": frames},
        }
