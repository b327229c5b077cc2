"""`/v1/chat/completions`: a chat (text, or media decoded by `omnistage.media`) laid out by the processor,
answered in text and, with `modalities` "audio", spoken through the Talker too (speech.py spells the audio)."""

from __future__ import annotations

import asyncio
import uuid

import jinja2
from fastapi import Request
from fastapi.responses import Response

from omnistage.errors import InvalidRequest
from omnistage.media import MediaPolicy, decode_messages
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server.errors import InvalidField
from omnistage.server.formats import ChatFormat, Format
from omnistage.server.protocol.chat import ChatCompletionRequest
from omnistage.server.speech import (
    CHAT_FORMATS,
    SpokenChatFormat,
    check_format,
    require_talker,
    speech_params,
)
from omnistage.server.streaming import Responder

PATH = "/v1/chat/completions"


class ChatEndpoint:
    def __init__(self, responder: Responder, frontend: Frontend, media: MediaPolicy) -> None:
        self.responder, self.frontend, self.media = responder, frontend, media

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        speech = chat_speech_params(body, self.frontend.voices)
        params = body.sampling_params(body.requested_max_tokens)
        request_id, name = f"chatcmpl-{uuid.uuid4().hex}", self.responder.served_model_name
        fmt: Format = ChatFormat(request_id, name, body.include_usage)
        if speech is not None and body.audio is not None:
            fmt = SpokenChatFormat(request_id, name, body.include_usage, body.audio.format)
        new = await asyncio.to_thread(self._request, body, request_id, params, speech)
        return await self.responder.respond(request, PATH, fmt, new, bool(body.stream))

    def _request(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        params: SamplingParams,
        speech: SpeechParams | None,
    ) -> GenerationRequest:
        """The chat's request, its prompt laid out by the processor. Runs in a worker thread: fetching,
        decoding and tokenizing let go of the GIL for the event loop."""
        messages, add_generation_prompt = body.message_dicts(), body.add_generation_prompt
        processor, context = self.frontend.processor, self.frontend.max_model_len
        try:
            if not body.has_media():
                prompt, ids = processor.encode_chat(messages, add_generation_prompt, context)
                return GenerationRequest(request_id, ids, params, prompt, speech=speech)
            video = body.video_options()
            decoded = decode_messages(messages, self.media, video)
            laid_out = processor.process_chat(
                decoded, add_generation_prompt, context, video.use_audio_in_video
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the chat template rejected them ({exc})") from None
        if params.max_tokens is None:  # a chat to Qwen3-ASR is capped as its clip's transcription is
            params.max_tokens = laid_out.max_tokens
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        return GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm, speech)


def chat_speech_params(body: ChatCompletionRequest, voices: tuple[str, ...]) -> SpeechParams | None:
    """A chat request's SpeechParams, or None when it asks for text alone; every refusal names its field."""
    if not body.asks_for_audio():
        return None
    asked_by = "modalities" if "audio" in (body.modalities or ()) else "audio"
    require_talker(voices, asked_by)
    if body.audio is None:
        raise InvalidField("audio", "is required when modalities has 'audio': give its voice and format")
    if asked_by == "audio":
        raise InvalidField("modalities", "must include 'audio' for the reply to be spoken (audio is set)")
    if not body.add_generation_prompt:
        raise InvalidField(
            "add_generation_prompt", "must be true for a spoken reply: the Talker speaks the turn it opens"
        )
    check_format(body.audio.format, CHAT_FORMATS, "audio.format")
    if body.stream and body.audio.format != "pcm16":
        raise InvalidField(
            "audio.format",
            "a streamed reply's audio is pcm16 (raw 16-bit little-endian samples, 24 kHz mono), as "
            f"OpenAI streams it; ask for 'pcm16', got {body.audio.format!r}",
        )
    talker = body.audio.talker_params(body.seed, prefix="audio.")
    return speech_params(body.audio.voice, voices, "audio.voice", talker)
