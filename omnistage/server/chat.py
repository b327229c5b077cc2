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
from omnistage.server.formats import ChatFormat, ToolChatFormat
from omnistage.server.protocol.chat import ChatCompletionRequest, NamedToolChoice
from omnistage.server.speech import (
    CHAT_FORMATS,
    SpokenChatFormat,
    check_format,
    require_talker,
    speech_params,
)
from omnistage.server.spoken_answers import SpokenAnswers
from omnistage.server.streaming import Responder
from omnistage.server.tool_calls import tool_constraint
from omnistage.server.voices import Voices

PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ChatServing:
    """What chat reads beside the Frontend: the voices by name, the spoken answers a later turn may refer
    to, and the responses' `system_fingerprint`."""

    voices: Voices
    answers: SpokenAnswers
    fingerprint: str


class ChatEndpoint:
    def __init__(
        self, responder: Responder, frontend: Frontend, media: MediaPolicy, serving: ChatServing
    ) -> None:
        self.responder, self.frontend, self.media, self.serving = responder, frontend, media, serving

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        speech = chat_speech_params(body, self.serving.voices)
        params = body.sampling_params(body.requested_max_tokens, body.max_tokens_field)
        calling = tools_in_play(body, self.frontend.processor, speech is not None)
        if calling:
            functions = [tool.function.model_dump() for tool in body.tools or ()]
            choice = body.tool_choice
            chosen = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice or "auto"
            params.structured = tool_constraint(functions, chosen, body.parallel_tool_calls is not False)
        transcripts = earlier_answers(body, self.serving.answers)
        request_id, name = f"chatcmpl-{uuid.uuid4().hex}", self.responder.served_model_name
        fingerprint = self.serving.fingerprint
        fmt: ChatFormat = (ToolChatFormat if calling else ChatFormat)(
            request_id, name, body.include_usage, fingerprint
        )
        if speech is not None and body.audio is not None:
            answers, audio_format = self.serving.answers, body.audio.format
            fmt = SpokenChatFormat(request_id, name, body.include_usage, audio_format, answers, fingerprint)
        new = await asyncio.to_thread(self._request, body, transcripts, request_id, params, speech)
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
        processor, context, tools = self.frontend.processor, self.frontend.max_model_len, body.tool_dicts()
        try:
            if not body.has_media():
                prompt, ids = processor.encode_chat(messages, add_generation_prompt, context, tools)
                return GenerationRequest(request_id, ids, params, prompt, speech=speech)
            video = body.video_options()
            decoded = decode_messages(messages, self.media, video)
            laid_out = processor.process_chat(
                decoded, add_generation_prompt, context, video.use_audio_in_video, tools
            )
        except jinja2.TemplateError as exc:
            raise InvalidField("messages", f"the chat template rejected them ({exc})") from None
        if params.max_tokens is None:  # a chat to Qwen3-ASR is capped as its clip's transcription is
            params.max_tokens = laid_out.max_tokens
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        return GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm, speech)


def tools_in_play(body: ChatCompletionRequest, processor: object, spoken: bool) -> bool:
    """Whether the reply may call the request's tools (and is parsed for calls); every refusal names its field.

    Tools reach the model only through a chat template that renders them: with one that does not, they would
    be dropped unseen, so they are refused."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise InvalidField("tool_choice", "requires tools: there is nothing to call")
        return False
    if not getattr(processor, "renders_tools", False):
        raise InvalidField("tools", "this checkpoint's chat template does not render tools")
    if choice == "none":
        return False
    if spoken:
        raise InvalidField("modalities", "a spoken reply cannot call tools; ask for text, or send no tools")
    return True


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
