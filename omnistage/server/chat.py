"""`/v1/chat/completions`: a chat (text, or media decoded by `omnistage.media`) laid out by the processor,
answered in text and, with `modalities` "audio", spoken through the Talker too (speech.py spells the audio)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import Response

from omnistage.media import MediaPolicy, decode_messages
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server.errors import InvalidField
from omnistage.server.formats import ChatFormat, ReasoningChatFormat
from omnistage.server.protocol.chat import ChatCompletionRequest
from omnistage.server.reasoning import opens_thinking
from omnistage.server.speech import (
    CHAT_FORMATS,
    SpokenChatFormat,
    check_format,
    require_talker,
    speech_params,
)
from omnistage.server.spoken_answers import SpokenAnswers
from omnistage.server.streaming import Responder
from omnistage.server.voices import Voices

PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ChatServing:
    """What chat reads beside the Frontend: the voices by name, the spoken answers a later turn may refer
    to, the responses' `system_fingerprint`, and the reasoning parser that splits a Thinking model's think
    block into `reasoning_content` (reasoning.py; None: the reply is all content)."""

    voices: Voices
    answers: SpokenAnswers
    fingerprint: str
    reasoning_parser: str | None = None


class ChatEndpoint:
    def __init__(
        self, responder: Responder, frontend: Frontend, media: MediaPolicy, serving: ChatServing
    ) -> None:
        self.responder, self.frontend, self.media, self.serving = responder, frontend, media, serving

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        speech = chat_speech_params(body, self.serving.voices)
        params = body.sampling_params(body.requested_max_tokens, body.max_tokens_field)
        transcripts = earlier_answers(body, self.serving.answers)
        request_id, name = f"chatcmpl-{uuid.uuid4().hex}", self.responder.served_model_name
        fingerprint = self.serving.fingerprint
        new = await asyncio.to_thread(self._request, body, transcripts, request_id, params, speech)
        fmt: ChatFormat = ChatFormat(request_id, name, body.include_usage, fingerprint)
        if speech is not None and body.audio is not None:
            answers, audio_format = self.serving.answers, body.audio.format
            fmt = SpokenChatFormat(request_id, name, body.include_usage, audio_format, answers, fingerprint)
        elif self.serving.reasoning_parser is not None:
            inside = opens_thinking(new.prompt or "")
            fmt = ReasoningChatFormat(request_id, name, body.include_usage, fingerprint, inside)
        fmt.prompt_audio_tokens = sum(getattr(new.mm, "num_audio_tokens", None) or ())
        return await self.responder.respond(request, PATH, fmt, new, bool(body.stream))

    def _request(
        self,
        body: ChatCompletionRequest,
        transcripts: Mapping[int, str],
        request_id: str,
        params: SamplingParams,
        speech: SpeechParams | None,
    ) -> GenerationRequest:
        """The chat's request, its prompt laid out by the processor. Runs in a worker thread: fetching,
        decoding and tokenizing let go of the GIL for the event loop."""
        messages, add_generation_prompt = body.message_dicts(transcripts), body.add_generation_prompt
        processor, context = self.frontend.processor, self.frontend.max_model_len
        template_kwargs = body.chat_template_kwargs or {}
        try:
            if not body.has_media():
                prompt, ids = processor.encode_chat(messages, add_generation_prompt, context, template_kwargs)
                return GenerationRequest(request_id, ids, params, prompt, speech=speech)
            video = body.video_options()
            decoded = decode_messages(messages, self.media, video)
            laid_out = processor.process_chat(
                decoded, add_generation_prompt, context, video.use_audio_in_video, template_kwargs
            )
        except jinja2.TemplateError as exc:
            raise InvalidField("messages", f"the chat template rejected them ({exc})") from None
        if params.max_tokens is None:  # a chat to Qwen3-ASR is capped as its clip's transcription is
            params.max_tokens = laid_out.max_tokens
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        return GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm, speech)


def earlier_answers(body: ChatCompletionRequest, answers: SpokenAnswers) -> dict[int, str]:
    """The transcript of each message (by index) that refers to an earlier spoken answer by its audio id; an
    id no answer kept has is a 400 naming it."""
    found = {}
    for i, message in enumerate(body.messages):
        if message.audio is None:
            continue
        transcript = answers.transcript(message.audio.id)
        if transcript is None:
            raise InvalidField(
                f"messages[{i}].audio.id",
                f"no spoken answer {message.audio.id!r} is kept: it is unknown, or it expired (answers are kept "
                f"{answers.retention_s} s, at most {answers.max_answers:,} of them); send its transcript as the "
                "content instead",
            )
        found[i] = transcript
    return found


def chat_speech_params(body: ChatCompletionRequest, voices: Voices) -> SpeechParams | None:
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
