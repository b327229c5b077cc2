"""`/v1/chat/completions`' request: messages of text and media parts, and the fields OpenAI's chat schema
adds to sampling (logprobs, the tools this server refuses, the audio reply it speaks), with vLLM's and
SGLang-Omni's video fields (`use_audio_in_video`, `mm_processor_kwargs`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from omnistage.media import VideoOptions
from omnistage.request import MAX_LOGPROBS, StructuredOutput
from omnistage.server.errors import InvalidField
from omnistage.server.protocol.base import (
    Int64,
    Open,
    SamplingRequest,
    Strict,
    empty,
    never,
    unless,
)
from omnistage.server.protocol.speech import ChatAudioParams

LEGACY = "functions and function_call are OpenAI's legacy form: send tools and tool_choice"
_PART_TYPES = ("text", "input_audio", "audio_url", "image_url", "video_url")


class InputAudio(Strict):
    data: str
    format: str  # checked where it is decoded, so an unknown one is an InvalidMedia naming the choices


class MediaURL(Open):
    url: str


class ContentPart(Open):
    """One element of a content array: text, or audio, an image or a video (decoded by `omnistage.media`)."""

    type: str
    text: str | None = None
    input_audio: InputAudio | None = None
    audio_url: MediaURL | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None

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


class AudioRef(Strict):
    """An earlier spoken answer, by its audio's id (OpenAI's multi-turn audio): the turn is its transcript."""

    id: str = Field(min_length=1)


class FunctionCall(Open):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallItem(Open):
    """One call an earlier assistant turn made (OpenAI's `tool_calls` item), rendered back by the template."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None


class ChatTool(Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Open):
    name: str


class NamedToolChoice(Open):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; the chat template does not render names
    refusal: str | None = None  # an earlier assistant refusal; accepted, not rendered
    tool_calls: list[ToolCallItem] | None = None
    function_call: dict[str, Any] | None = None
    tool_call_id: str | None = None
    audio: AudioRef | None = None  # an earlier spoken answer of the assistant, by id

    @model_validator(mode="after")
    def _supported(self) -> ChatMessage:
        if self.role == "function" or self.function_call:
            raise ValueError(f"the legacy function calling is not supported ({LEGACY})")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        if self.audio is not None:
            if self.role != "assistant":
                raise ValueError("audio: only an assistant message refers to an earlier spoken answer")
            if self.content:
                raise ValueError("give an earlier answer by its audio id or by its text (content), not both")
        elif self.content is None and not self.tool_calls:
            raise ValueError("content is missing")
        return self

    def template_dict(self, transcript: str | None = None) -> dict[str, Any]:
        """The message as the chat template takes it: OpenAI's developer role is the template's system, and
        an earlier spoken answer (`audio`) its `transcript`."""
        content: object = self.content if transcript is None else transcript
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class MultimodalProcessorKwargs(Strict):
    """vLLM's `mm_processor_kwargs`, the keys this server reads: how a request's videos are processed."""

    use_audio_in_video: bool | None = None
    fps: PositiveFloat | None = None
    max_frames: PositiveInt | None = None


class JsonSchemaFormat(Open):
    """OpenAI's `response_format.json_schema`: the output is held to `schema` whether `strict` or not."""

    name: str = Field(min_length=1)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _has_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its 'json_schema' field (name, schema)")
        return self

    def structured(self) -> StructuredOutput | None:
        """What constrained decoding holds the reply to; None for free text."""
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.json_schema is not None and self.type == "json_schema":
            return StructuredOutput(json_schema=json.dumps(self.json_schema.json_schema))
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name; wins over max_tokens
    add_generation_prompt: bool = True  # vLLM's

    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[dict[str, Any]] | None, unless(empty, LEGACY)] = None
    function_call: Annotated[
        Literal["none", "auto"] | dict[str, Any] | None, unless(lambda c: c in ("none", "auto"), LEGACY)
    ] = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioParams | None = None
    # A video's sound track interleaved with its frames, as Qwen3-Omni was trained (top level, as vLLM and
    # SGLang-Omni take it); the sampling rate and frame cap within the server's bounds.
    use_audio_in_video: bool | None = None
    video_fps: PositiveFloat | None = None
    video_max_frames: PositiveInt | None = None
    mm_processor_kwargs: MultimodalProcessorKwargs | None = None
    # vLLM's: more variables for the chat template (`enable_thinking`); a key it does not read changes nothing.
    chat_template_kwargs: dict[str, Any] | None = None
    web_search_options: Annotated[dict[str, Any] | None, unless(never, "web search is not supported")] = None
    moderation: Annotated[dict[str, Any] | None, unless(never, "moderation is not supported")] = None

    # Accepted and ignored: nothing the client gets from this server depends on them.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidField("top_logprobs", "needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` comes from."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of `response_format`, if it sets one."""
        return self.response_format.structured() if self.response_format is not None else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_options(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in ("messages", "add_generation_prompt"):
            if value is not None and name in value:
                raise ValueError(f"{name!r} is the request's own field, not a template option")
        return value

    def asks_for_audio(self) -> bool:
        return self.audio is not None or "audio" in (self.modalities or ())

    def has_media(self) -> bool:
        return any(
            isinstance(m.content, list) and any(p.is_media() for p in m.content) for m in self.messages
        )

    def video_options(self) -> VideoOptions:
        """What the request asks of its videos: the top-level fields, else mm_processor_kwargs'."""
        given = self.mm_processor_kwargs or MultimodalProcessorKwargs()
        audio = self.use_audio_in_video if self.use_audio_in_video is not None else given.use_audio_in_video
        return VideoOptions(
            use_audio_in_video=bool(audio),
            fps=self.video_fps if self.video_fps is not None else given.fps,
            max_frames=self.video_max_frames if self.video_max_frames is not None else given.max_frames,
        )

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape), or None without any."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def message_dicts(self, transcripts: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
        """Messages as the chat template takes them; `transcripts` holds the text of each message (by index)
        that refers to an earlier spoken answer."""
        transcripts = transcripts or {}
        return [m.template_dict(transcripts.get(i)) for i, m in enumerate(self.messages)]
