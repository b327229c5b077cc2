"""The client events of OpenAI's Realtime API as the `openai` SDK sends them, validated once at the edge.

Every event arrives as one JSON text frame and is parsed into one of the models below (a union on `type`);
whatever fails is answered with an `error` event naming the field (`param`) and the event's `event_id`, and
the session goes on. Objects OpenAI keeps adding optional keys to (the session, an item's content) accept and
ignore what this server does not read; the keys it reads are strictly typed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from omnistage.server.errors import field_path

NonNegative = Annotated[int, Field(ge=0, le=2**31 - 1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Open(Strict):
    """Optional keys beyond those this server reads are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


class AudioFormat(Open):
    """pcm16 at 24 kHz (`audio/pcm`, OpenAI's default), or G.711 at 8 kHz (`audio/pcmu`, `audio/pcma`)."""

    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: Literal[24000] | None = None


class TurnDetection(Open):
    """Server VAD; `semantic_vad` is served by the same detector with its defaults."""

    type: Literal["server_vad", "semantic_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: NonNegative | None = None
    silence_duration_ms: NonNegative | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


class Transcription(Open):
    """A transcription session's settings (`model` is the client's name for the transcriber: ignored)."""

    language: str | None = None
    prompt: str | None = None


class InputAudio(Open):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None  # null turns it off; absent keeps it
    transcription: Transcription | None = None


class VoiceId(Open):
    id: str


class OutputAudio(Open):
    format: AudioFormat | None = None
    voice: str | VoiceId | None = None
    speed: Annotated[float, Field(ge=0.25, le=1.5)] | None = None


class AudioConfig(Open):
    input: InputAudio | None = None
    output: OutputAudio | None = None


class FunctionTool(Open):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamedTool(Open):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedTool
Modalities = list[Literal["text", "audio"]]
MaxOutputTokens = Annotated[int, Field(ge=1, le=2**31 - 1)] | Literal["inf"]


class SessionConfig(Open):
    """`session.update`'s session: a realtime (conversation) or transcription session."""

    type: Literal["realtime", "transcription"] | None = None
    instructions: str | None = None
    output_modalities: Annotated[Modalities, Field(min_length=1, max_length=1)] | None = None
    audio: AudioConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxOutputTokens | None = None


class ContentPart(Open):
    """A message's content: text (`input_text`, `output_text`, `text`) or audio (`input_audio` with base64 audio
    in the session's input format, `output_audio` with its transcript)."""

    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None


class MessageItem(Open):
    type: Literal["message"]
    id: str | None = Field(None, min_length=1, max_length=64)
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart]


class FunctionCallItem(Open):
    type: Literal["function_call"]
    id: str | None = Field(None, min_length=1, max_length=64)
    name: str
    arguments: str
    call_id: str | None = None


class FunctionCallOutputItem(Open):
    type: Literal["function_call_output"]
    id: str | None = Field(None, min_length=1, max_length=64)
    call_id: str
    output: str


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class ResponseAudioOutput(Open):
    format: AudioFormat | None = None
    voice: str | VoiceId | None = None


class ResponseAudio(Open):
    output: ResponseAudioOutput | None = None


class ResponseParams(Open):
    """`response.create`'s overrides of the session for this one response."""

    instructions: str | None = None
    output_modalities: Annotated[Modalities, Field(min_length=1, max_length=1)] | None = None
    audio: ResponseAudio | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxOutputTokens | None = None
    conversation: Literal["auto"] | None = None  # out-of-band responses ("none") are refused
    metadata: dict[str, str] | None = None


class Event(Strict):
    event_id: str | None = None


class SessionUpdate(Event):
    type: Literal["session.update"]
    session: SessionConfig


class BufferAppend(Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(Event):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: str | None = None


class ItemDelete(Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemTruncate(Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: NonNegative
    audio_end_ms: NonNegative


class ResponseCreate(Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | BufferAppend
    | BufferCommit
    | BufferClear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
)
_EVENTS: TypeAdapter[ClientEvent] = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])
SUPPORTED = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "conversation.item.truncate",
    "response.create",
    "response.cancel",
)


class BadEvent(Exception):
    """A frame that is no valid client event: OpenAI's error `code`, the field at fault, and the event's id
    where the frame had one."""

    def __init__(
        self, message: str, code: str, param: str | None = None, event_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


class SessionError(Exception):
    """A valid event the session cannot carry out: OpenAI's error code and the field at fault."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


# pydantic's error types as OpenAI's codes
_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def parse_event(frame: str | bytes) -> ClientEvent:
    """The client event in one frame; raises BadEvent."""
    try:
        return _EVENTS.validate_json(frame)
    except ValidationError as exc:
        raise _bad(exc, frame) from None


def _bad(exc: ValidationError, frame: str | bytes) -> BadEvent:
    errors = exc.errors(include_url=False)
    first, kind = errors[0], errors[0]["type"]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return BadEvent(f"the event is not valid JSON ({reason})", "invalid_json")
    event_id = _event_id(frame)
    if kind == "union_tag_not_found":
        return BadEvent("the event has no `type`", "missing_required_parameter", "type", event_id)
    if kind == "union_tag_invalid":
        given = (first.get("ctx") or {}).get("tag", "")
        message = f"unknown event type {given!r}; this server takes {', '.join(SUPPORTED)}"
        return BadEvent(message, "invalid_value", "type", event_id)
    loc = tuple(first["loc"])
    if not loc:
        return BadEvent("an event is a JSON object with a `type`", "invalid_type", None, event_id)
    # the event's type leads the path, and pydantic names a union's members (`constrained-int`): the client
    # wrote neither
    path = field_path(tuple(part for part in loc[1:] if not (isinstance(part, str) and "-" in part)))
    reason = "unknown field" if kind == "extra_forbidden" else first["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    code = _CODES.get(kind, "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return BadEvent(f"{path}: {reason}{more}" if path else reason + more, code, path or None, event_id)


def _event_id(frame: str | bytes) -> str | None:
    """The frame's `event_id` where it is a JSON object with a string one (an error quotes it back)."""
    try:
        value = TypeAdapter(dict[str, Any]).validate_json(frame).get("event_id")
    except ValidationError:
        return None
    return value if isinstance(value, str) else None
