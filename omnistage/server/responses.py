"""The OpenAI HTTP protocol's responses as pydantic models: bodies and stream chunks as OpenAI sends them
(the requests are in protocol/)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, field_serializer, model_serializer


def _now() -> int:
    return int(time.time())


class CompletionTokensDetails(BaseModel):
    text_tokens: int
    audio_tokens: int  # codec frames (12.5 per second of audio)


def _drop_if_none(data: dict[str, Any], name: str) -> dict[str, Any]:
    # OpenAI leaves the field out where it does not apply; a text reply reads exactly as before speech.
    if name in data and data[name] is None:
        del data[name]
    return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # not counted: prefix-cache hits are not reported per request
    audio_tokens: int  # the prompt's audio placeholders (a video's sound track among them)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # chat's
    completion_tokens_details: CompletionTokensDetails | None = None  # with speech: text and audio tokens

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = _drop_if_none(handler(self), "prompt_tokens_details")
        return _drop_if_none(data, "completion_tokens_details")

    def with_prompt_audio(self, audio_tokens: int) -> Usage:
        """This usage with its prompt's details: `audio_tokens` of the prompt are audio placeholders."""
        details = PromptTokensDetails(audio_tokens=audio_tokens)
        return self.model_copy(update={"prompt_tokens_details": details})

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, audio_tokens: int | None = None) -> Usage:
        """Usage of `completion_tokens` text tokens, plus `audio_tokens` codec frames when the reply spoke
        (counted in completion_tokens too, as OpenAI counts them)."""
        details = None
        if audio_tokens is not None:
            details = CompletionTokensDetails(text_tokens=completion_tokens, audio_tokens=audio_tokens)
            completion_tokens += audio_tokens
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            completion_tokens_details=details,
        )


class AssistantAudio(BaseModel):
    """A spoken reply; its transcript is kept until `expires_at`, for a later turn to refer to it by `id`
    (spoken_answers.py)."""

    id: str
    data: str  # base64 of the audio in the requested format
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is spoken (its text is the audio's transcript) or only calls
    reasoning_content: str | None = None  # a Thinking model's <think> block, as vLLM returns it
    audio: AssistantAudio | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's {"id", "type": "function", "function"}

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = _drop_if_none(_drop_if_none(handler(self), "audio"), "reasoning_content")
        return _drop_if_none(dumped, "tool_calls")


class TopLogprob(BaseModel):
    """One token's log-probability: its text and UTF-8 bytes (server/logprobs.py)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the most likely tokens at its position, most likely first


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None  # the model has no refusals of its own


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class DeltaAudio(BaseModel):
    """A piece of a streamed spoken reply: the id on the first, then transcript text or base64 pcm16, and
    `expires_at` alone on the last (as OpenAI streams audio)."""

    id: str | None = None
    transcript: str | None = None
    data: str | None = None
    expires_at: int | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    audio: DeltaAudio | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's {"index", "id"?, "type"?, "function"}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta(self, delta: ChatDelta) -> dict[str, Any]:
        # OpenAI leaves unset delta fields out: {"content": "Hi"}, and {} on the finishing chunk.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Text completions' legacy shape: per token its text, logprob, top tokens' and character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and, with `object` "text_completion" too, each streamed chunk (as OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnistage"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
