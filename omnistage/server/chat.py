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
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams, StructuredOutput
from omnistage.server.errors import InvalidField
from omnistage.server.formats import ChatFormat, ReasoningChatFormat, ToolChatFormat
from omnistage.server.logprobs import LazyTokenTexts
from omnistage.server.protocol.chat import ChatCompletionRequest, NamedToolChoice
from omnistage.server.reasoning import opens_thinking
from omnistage.server.samples import Sample, SampledAnswer, fan_out
from omnistage.server.speech import (
    CHAT_FORMATS,
    CHAT_STREAM_FORMATS,
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
        self.texts = LazyTokenTexts(frontend)

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        formats, new = await self.prepare(body, f"chatcmpl-{uuid.uuid4().hex}")
        stream = bool(body.stream)
        if len(formats) == 1:
            return await self.responder.respond(request, PATH, formats[0], new, stream)
        samples = [Sample(child, fmt) for child, fmt in zip(fan_out(new, len(formats)), formats, strict=True)]
        return await SampledAnswer(self.responder, PATH, samples).respond(request, stream)

    async def prepare(
        self, body: ChatCompletionRequest, request_id: str
    ) -> tuple[list[ChatFormat], GenerationRequest]:
        """The chat's request for the pipeline and the format of each of its `n` choices; every refusal is an
        InvalidField naming the chat's field. The Responses API answers its requests through this too."""
        speech = chat_speech_params(body, self.serving.voices)
        if speech is not None and body.choices > 1:
            raise InvalidField("n", "a spoken reply has one choice: ask for n > 1 with a text reply")
        params = body.sampling_params(body.requested_max_tokens, body.max_tokens_field)
        if speech is not None and params.logprobs is not None:
            raise InvalidField(
                "logprobs", "a spoken reply carries no logprobs; ask for them with a text reply"
            )
        if self.serving.reasoning_parser is not None and params.logprobs is not None:
            raise InvalidField("logprobs", "logprobs of a reasoning model's reply are not supported yet")
        params.structured = body.structured_output()
        calling = tools_in_play(body, self.frontend.processor, speech is not None)
        if calling and params.logprobs is not None:
            raise InvalidField("logprobs", "logprobs of a reply that may call tools are not supported yet")
        if calling:
            functions = [tool.function.model_dump() for tool in body.tools or ()]
            choice = body.tool_choice
            chosen = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice or "auto"
            constraint = tool_constraint(functions, chosen, body.parallel_tool_calls is not False)
            if constraint is not None and params.structured is not None:
                raise InvalidField(
                    "response_format", "a reply that must call a tool cannot also follow a format"
                )
            params.structured = constraint or params.structured
        transcripts = earlier_answers(body, self.serving.answers)
        new = await asyncio.to_thread(self._request, body, transcripts, request_id, params, speech)
        name, fingerprint = self.responder.served_model_name, self.serving.fingerprint
        usage, continuous = body.include_usage, body.continuous_usage
        texts = self.texts.get() if params.logprobs is not None else None
        prompt_audio_tokens = sum(getattr(new.mm, "num_audio_tokens", None) or ())

        def format_of(index: int) -> ChatFormat:
            fmt: ChatFormat
            if speech is not None and body.audio is not None:
                answers, audio_format = self.serving.answers, body.audio.format
                fmt = SpokenChatFormat(
                    request_id, name, usage, audio_format, answers, fingerprint, continuous
                )
            elif self.serving.reasoning_parser is not None:
                inside = opens_thinking(new.prompt or "")
                fmt = ReasoningChatFormat(
                    request_id, name, usage, fingerprint, inside, index=index, continuous_usage=continuous
                )
            elif calling:
                fmt = ToolChatFormat(
                    request_id, name, usage, fingerprint, index=index, continuous_usage=continuous
                )
            else:
                fmt = ChatFormat(
                    request_id, name, usage, fingerprint, texts, index=index, continuous_usage=continuous
                )
            fmt.prompt_audio_tokens = prompt_audio_tokens
            return fmt

        return [format_of(index) for index in range(body.choices)], new

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
        if params.structured is not None:
            check_constraint(params.structured)
        messages, add_generation_prompt = body.message_dicts(transcripts), body.add_generation_prompt
        processor, context, tools = self.frontend.processor, self.frontend.max_model_len, body.tool_dicts()
        template_kwargs = body.chat_template_kwargs or {}
        try:
            if not body.has_media():
                prompt, ids = processor.encode_chat(
                    messages, add_generation_prompt, context, template_kwargs, tools
                )
                return GenerationRequest(request_id, ids, params, prompt, speech=speech)
            video = body.video_options()
            decoded = decode_messages(messages, self.media, video)
            laid_out = processor.process_chat(
                decoded, add_generation_prompt, context, video.use_audio_in_video, template_kwargs, tools
            )
        except jinja2.TemplateError as exc:
            raise InvalidField("messages", f"the chat template rejected them ({exc})") from None
        if params.max_tokens is None:  # a chat to Qwen3-ASR is capped as its clip's transcription is
            params.max_tokens = laid_out.max_tokens
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        return GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm, speech)


def check_constraint(structured: StructuredOutput) -> None:
    """A 400 naming the field (`response_format`, `tools`) of a constraint the grammar library refuses; the
    engine compiles it against the vocabulary once it is admitted."""
    # imported here: xgrammar's import takes seconds, which a server never asked for a constraint never pays
    from omnistage.engine.structured import InvalidConstraint, check

    try:
        check(structured)
    except InvalidConstraint as exc:
        raise InvalidField(exc.param, exc.reason) from None


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
    if body.stream and body.audio.format not in CHAT_STREAM_FORMATS:
        raise InvalidField(
            "audio.format",
            f"a streamed reply's audio is {', '.join(CHAT_STREAM_FORMATS)}, encoded as it is spoken; a "
            f"{body.audio.format} file is whole only (ask without stream)",
        )
    talker = body.audio.talker_params(body.seed, prefix="audio.")
    return speech_params(body.audio.voice, voices, "audio.voice", talker)
