"""The OpenAI HTTP protocol as pydantic models: requests checked field by field, responses as OpenAI sends them.

Requests are strict (an unknown field is a 400 naming it) but accept the fields common clients send by
default. Sampling extras that OpenAI lacks (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, ...)
carry vLLM's names, so clients pass them through `extra_body` unchanged.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from omnistage.engine.sampling import SamplingParams
from omnistage.errors import InvalidRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted for vLLM clients; usage arrives once, at the end


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag; accepted and ignored
    logit_bias: dict[str, float] | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's SamplingParams; unset fields take the engine's defaults. Raises InvalidRequest."""
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported")
        names = (
            "n temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
            "repetition_penalty min_tokens ignore_eos skip_special_tokens include_stop_str_in_output"
        ).split()
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, **values)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- chat completions -------------------------------------------------------------------------------------


_PART_TYPES = ("text", "input_audio", "audio_url", "image_url")


class InputAudio(_Strict):
    data: str
    format: str  # checked where it is decoded, so an unknown one is an InvalidMedia naming the choices


class MediaURL(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url's "detail" and the like: accepted, ignored
    url: str


class ContentPart(BaseModel):
    """One element of a content array: text, or audio or an image (decoded by `server.media`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    input_audio: InputAudio | None = None
    audio_url: MediaURL | None = None
    image_url: MediaURL | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in _PART_TYPES:
            raise ValueError(
                f"content parts of type {value!r} are not supported; use one of {', '.join(_PART_TYPES)}"
            )
        return value

    @model_validator(mode="after")
    def _has_payload(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"{self.type} parts need their {self.type!r} field")
        return self

    def is_media(self) -> bool:
        return self.type != "text"


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs are not supported yet")
        if self.tools:
            raise InvalidRequest("tools are not supported yet")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest(
                f"response_format {self.response_format.type!r} is not supported; only 'text' is"
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def has_media(self) -> bool:
        return any(
            isinstance(m.content, list) and any(p.is_media() for p in m.content) for m in self.messages
        )

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (OpenAI's shape, unset fields left out)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]


# -- text completions -------------------------------------------------------------------------------------


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        if self.echo:
            raise InvalidRequest("echo is not supported")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported yet")
        if self.best_of not in (None, 1):
            raise InvalidRequest(f"best_of must be 1, got {self.best_of}")
        if self.suffix:
            raise InvalidRequest("suffix is not supported")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several is a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest(f"prompt: one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt: must not be empty")
        return prompt


# -- responses --------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta(self, delta: ChatDelta) -> dict[str, str]:
        # OpenAI leaves unset delta fields out: {"content": "Hi"}, and {} on the finishing chunk.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
