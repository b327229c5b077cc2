"""The OpenAI HTTP protocol's requests as pydantic models, checked field by field (responses.py: the replies).

Requests are strict: an unknown field is a 400 naming it, and so is a value of the wrong JSON type
(`"stream": "yes"`, `"temperature": true`; an integer is still a number), an integer beyond int64 or a
number that is not finite. Every field of OpenAI's current request schemas is accepted: honoured, ignored
where ignoring it changes nothing the client gets (see the README), or refused with a 400 naming the field
where ignoring it would (`n` > 1, logprobs, tools, JSON response formats). Sampling extras that OpenAI
lacks (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, ...) carry vLLM's names, so clients pass
them through `extra_body` unchanged; the Talker's take the same names beside `max_frames`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from omnistage.errors import InvalidRequest
from omnistage.request import MAX_AUDIO_FRAMES, SamplingParams, talker_sampling_defaults
from omnistage.server.errors import InvalidField

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
TOOLS = "tools are not supported yet"
LOGPROBS = "logprobs are not supported yet"
# OpenAI documents 4,096 characters as the most /v1/audio/speech speaks in one request.
MAX_SPEECH_INPUT = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Open(_Strict):
    """An object OpenAI keeps adding optional keys to (image_url.detail, prompt_cache_breakpoint, ...):
    those are accepted and ignored; the known keys are still strictly typed."""

    model_config = ConfigDict(extra="allow")


def _unless(harmless: Callable[[Any], bool], reason: str) -> AfterValidator:
    """A field this server cannot honour: refused with `reason` (formatted with the value) unless the value
    the client sent changes nothing."""

    def check(value: Any) -> Any:
        if value is not None and not harmless(value):
            raise ValueError(reason.format(value=value))
        return value

    return AfterValidator(check)


def _empty(value: Any) -> bool:
    return not value


def _never(value: Any) -> bool:
    return False


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # OpenAI pads stream chunks against length side channels; this server sends no padding either way.
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = False  # accepted for vLLM clients; usage arrives once, at the end


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    n: Annotated[
        Int64 | None, _unless(lambda n: n == 1, "n must be 1 (one choice per request), got {value}")
    ] = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[dict[str, float] | None, _unless(_empty, "logit_bias is not supported")] = None
    user: str | None = None  # OpenAI's end-user tag: ignored
    store: bool | None = None  # ignored: nothing is stored (chat's field; clients send it to completions too)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's SamplingParams; unset fields take the engine's defaults. Raises InvalidRequest."""
        names = (
            "temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
            "repetition_penalty min_tokens ignore_eos skip_special_tokens include_stop_str_in_output"
        ).split()
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, **values)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


# -- chat completions -------------------------------------------------------------------------------------


_PART_TYPES = ("text", "input_audio", "audio_url", "image_url")


class InputAudio(_Strict):
    data: str
    format: str  # checked where it is decoded, so an unknown one is an InvalidMedia naming the choices


class MediaURL(_Open):
    url: str


class ContentPart(_Open):
    """One element of a content array: text, or audio or an image (decoded by `omnistage.media`)."""

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
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; the chat template does not render names
    refusal: str | None = None  # an earlier assistant refusal; accepted, not rendered
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    tool_call_id: str | None = None
    audio: dict[str, Any] | None = None  # an earlier assistant audio answer, by id: refused, none is kept

    @model_validator(mode="after")
    def _supported(self) -> ChatMessage:
        if self.role in ("tool", "function"):
            raise ValueError(f"{self.role!r} messages are not supported ({TOOLS})")
        if self.tool_calls or self.function_call:
            raise ValueError(f"tool calls are not supported ({TOOLS})")
        if self.audio is not None:
            raise ValueError(
                "audio output is not supported in messages: no audio answer is kept, so none can be referred "
                "to by its id; send its transcript as the content"
            )
        if self.content is None:
            raise ValueError("content is missing")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: OpenAI's developer role is the template's system."""
        content: object = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(_Open):
    type: str


def _text_format(value: ResponseFormat) -> ResponseFormat:
    if value.type != "text":
        raise ValueError(f"response_format {value.type!r} is not supported; only 'text' is")
    return value


class VoiceRef(_Strict):
    """OpenAI's custom-voice object: `{"id": "ethan"}` names a voice as the plain string does."""

    id: str


def _voice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    return "dict[str, str]" if isinstance(value, dict | VoiceRef) else None


# Tagged by the JSON shape, as Prompt is, so that an error's path is the client's (`voice`, `voice.id`) and never
# names this class (the tags are left out of paths).
Voice = Annotated[
    Annotated[str, Tag("str")] | Annotated[VoiceRef, Tag("dict[str, str]")],
    Discriminator(
        _voice_kind,
        custom_error_type="voice_type",
        custom_error_message='Input should be a voice\'s name or an object naming it ({"id": name})',
    ),
]
# The pipeline's cap on the audio of one request; above it a request is refused here, naming its field.
Frames = Annotated[Int64, Field(le=MAX_AUDIO_FRAMES)]


class _TalkerFields(_Strict):
    """This server's controls of the Talker (not OpenAI's): the most codec frames to speak (12.5 per
    second of audio; unset, a cap proportional to the text) and sampling over the released defaults."""

    max_frames: Annotated[Frames, Field(ge=1)] | None = None
    # benchmarks on random weights, as vLLM's min_tokens and ignore_eos for text: the codec's end is not drawn
    # before min_frames, or never with ignore_eos
    min_frames: Annotated[Frames, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    repetition_penalty: float | None = None

    def talker_params(self, seed: int | None, prefix: str = "") -> SamplingParams:
        """The Talker's SamplingParams; `seed` also seeds the code predictor. Raises InvalidField naming the
        field at fault below `prefix` (chat's "audio.")."""
        if self.min_frames and self.max_frames is not None and self.min_frames > self.max_frames:
            raise InvalidField(
                f"{prefix}min_frames",
                f"min_frames ({self.min_frames}) must not exceed max_frames ({self.max_frames})",
            )
        defaults = talker_sampling_defaults()
        given = {
            name: value
            for name in ("temperature", "top_p", "top_k", "repetition_penalty", "ignore_eos")
            if (value := getattr(self, name)) is not None
        }
        if self.min_frames is not None:
            given["min_tokens"] = self.min_frames
        for (
            name,
            value,
        ) in given.items():  # one at a time, so that the error names the field that broke a rule
            try:
                replace(defaults, **{name: value})
            except InvalidRequest as exc:
                raise InvalidField(prefix + _TALKER_FIELD.get(name, name), str(exc)) from None
        return replace(defaults, max_tokens=self.max_frames, seed=seed, **given)


_TALKER_FIELD = {
    "min_tokens": "min_frames"
}  # SamplingParams' names of the request's fields, where they differ


class ChatAudioParams(_TalkerFields):
    """A chat request's `audio`: OpenAI's voice and format, and the Talker's controls."""

    voice: Voice
    format: str  # checked against what this server can encode, so an unknown one is a 400 naming those


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name; wins over max_tokens
    add_generation_prompt: bool = True  # vLLM's

    logprobs: Annotated[bool | None, _unless(_empty, LOGPROBS)] = None
    top_logprobs: Annotated[Int64 | None, _unless(_empty, LOGPROBS)] = None
    response_format: Annotated[ResponseFormat | None, AfterValidator(_text_format)] = None
    tools: Annotated[list[dict[str, Any]] | None, _unless(_empty, TOOLS)] = None
    functions: Annotated[list[dict[str, Any]] | None, _unless(_empty, TOOLS)] = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | dict[str, Any] | None,
        _unless(lambda c: c in ("none", "auto"), TOOLS + ", so none can be required"),
    ] = None
    function_call: Annotated[
        Literal["none", "auto"] | dict[str, Any] | None,
        _unless(lambda c: c in ("none", "auto"), TOOLS + ", so none can be required"),
    ] = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioParams | None = None
    web_search_options: Annotated[dict[str, Any] | None, _unless(_never, "web search is not supported")] = (
        None
    )
    moderation: Annotated[dict[str, Any] | None, _unless(_never, "moderation is not supported")] = None

    # Accepted and ignored: nothing the client gets from this server depends on them.
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def asks_for_audio(self) -> bool:
        return self.audio is not None or "audio" in (self.modalities or ())

    def has_media(self) -> bool:
        return any(
            isinstance(m.content, list) and any(p.is_media() for p in m.content) for m in self.messages
        )

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them."""
        return [m.template_dict() for m in self.messages]


# -- text completions -------------------------------------------------------------------------------------


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return (
        "list[str]"
        if isinstance(first, str)
        else "list[list[int]]"
        if isinstance(first, list)
        else "list[int]"
    )


# Tagged by the JSON shape, so a bad element is reported once, at its index (the tags are left out of paths).
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[TokenId], Tag("list[int]")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, token ids, or a list of either",
    ),
]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    echo: Annotated[bool | None, _unless(_empty, "echo is not supported")] = None
    logprobs: Annotated[Int64 | None, _unless(_never, LOGPROBS)] = None
    best_of: Annotated[Int64 | None, _unless(lambda b: b == 1, "best_of must be 1, got {value}")] = None
    suffix: Annotated[str | None, _unless(_empty, "suffix is not supported")] = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several is a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest(f"prompt: one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt: must not be empty")
        return cast("str | list[int]", prompt)  # a batch's one prompt is a str or a list of ids


# -- speech ---------------------------------------------------------------------------------------------


class SpeechRequest(_TalkerFields):
    """`/v1/audio/speech`: speak exactly `input`."""

    model: str
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT)
    voice: Voice
    response_format: str = "mp3"  # OpenAI's default; checked against what this server can encode
    stream_format: Literal["audio", "sse"] = "audio"
    speed: Annotated[
        float | None,
        _unless(lambda s: s == 1.0, "speed must be 1.0 (the Talker speaks at one speed), got {value}"),
    ] = None
    # The Talker's voice is the chosen speaker's; no instruction changes it, so one given is refused.
    instructions: Annotated[
        str | None, _unless(_empty, "instructions are not supported: the voice is set by `voice` alone")
    ] = None
    seed: Int64 | None = None  # this server's: seeds the Talker and the code predictor
    user: str | None = None  # OpenAI's end-user tag: ignored
