"""A session's settings: what `session.update` sets, what `session.created` and `session.updated` show, and what
one response reads once `response.create`'s overrides are laid over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from omnistage.server.errors import InvalidField
from omnistage.server.realtime import protocol
from omnistage.server.realtime.codecs import PCM, AudioFormat
from omnistage.server.voices import Voices

DEFAULT_VOICE = "alloy"  # OpenAI's default voice


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD's settings (OpenAI's defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    kind: str = "server_vad"

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


@dataclass(frozen=True)
class Settings:
    """One session's settings; `kind` is "realtime" (a conversation) or "transcription"."""

    kind: str
    model: str
    voice: str = DEFAULT_VOICE
    instructions: str = ""
    modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = AudioFormat(PCM)
    output_format: AudioFormat = AudioFormat(PCM)
    turn_detection: TurnDetection | None = TurnDetection()  # OpenAI's default: server VAD
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None  # None: as much as the context leaves ("inf")
    language: str | None = None  # a transcription session's, or a conversation's transcription of its input
    prompt: str | None = None
    transcribe_input: bool = False  # a conversation's: each committed user turn transcribed too
    metadata: dict[str, str] = field(default_factory=dict)

    def updated(self, given: protocol.SessionConfig, voices: Voices, spoken: bool) -> Settings:
        """These settings with what `session.update` sets (a key it leaves out keeps its value); raises
        InvalidField naming the session's field."""
        if given.type is not None and given.type != self.kind:
            raise InvalidField(
                "session.type", f"this is a {self.kind} session; it cannot become {given.type}"
            )
        new = self._replies(given, spoken, "session")
        audio = given.audio
        if audio is not None and audio.input is not None:
            new = new._input(audio.input)
        if audio is not None and audio.output is not None:
            if audio.output.format is not None:
                new = replace(new, output_format=AudioFormat(audio.output.format.type))
            if audio.output.voice is not None:
                new = replace(
                    new, voice=checked_voice(audio.output.voice, voices, "session.audio.output.voice")
                )
        return new

    def _replies(
        self, given: protocol.SessionConfig | protocol.ResponseParams, spoken: bool, where: str
    ) -> Settings:
        """What `session.update` and `response.create` both set: instructions, modalities, tools, the limit."""
        new = self
        if given.instructions is not None:
            new = replace(new, instructions=given.instructions)
        if given.output_modalities is not None:
            new = replace(new, modalities=checked_modalities(given.output_modalities, spoken, where))
        if given.tools is not None:
            new = replace(new, tools=tuple(tool_dict(tool) for tool in given.tools))
        if given.tool_choice is not None:
            new = replace(new, tool_choice=choice_of(given.tool_choice))
        if given.parallel_tool_calls is not None:
            new = replace(new, parallel_tool_calls=given.parallel_tool_calls)
        if given.max_output_tokens is not None:
            limit = given.max_output_tokens
            new = replace(new, max_output_tokens=None if limit == "inf" else limit)
        return new

    def _input(self, given: protocol.InputAudio) -> Settings:
        new = self
        if given.format is not None:
            new = replace(new, input_format=AudioFormat(given.format.type))
        if "turn_detection" in given.model_fields_set:
            new = replace(new, turn_detection=turn_detection(given.turn_detection))
        if "transcription" in given.model_fields_set:
            wanted = given.transcription
            language, prompt = (wanted.language, wanted.prompt) if wanted is not None else (None, None)
            new = replace(new, language=language, prompt=prompt, transcribe_input=wanted is not None)
        return new

    def for_response(self, given: protocol.ResponseParams | None, voices: Voices, spoken: bool) -> Settings:
        """The settings one response runs with: the session's, with `response.create`'s overrides."""
        if given is None:
            return self
        new = self._replies(given, spoken, "response")
        if given.metadata is not None:
            new = replace(new, metadata=given.metadata)
        output = given.audio.output if given.audio is not None else None
        if output is not None and output.format is not None:
            new = replace(new, output_format=AudioFormat(output.format.type))
        if output is not None and output.voice is not None:
            new = replace(new, voice=checked_voice(output.voice, voices, "response.audio.output.voice"))
        return new

    @property
    def spoken(self) -> bool:
        return "audio" in self.modalities

    def as_dict(self) -> dict[str, Any]:
        """The session object of `session.created` and `session.updated`."""
        detection = self.turn_detection.as_dict() if self.turn_detection is not None else None
        if self.kind == "transcription":
            transcription = {"model": self.model, "language": self.language, "prompt": self.prompt}
            audio_in = {
                "format": self.input_format.as_dict(),
                "transcription": transcription,
                "turn_detection": detection,
            }
            return {
                "type": "transcription",
                "object": "realtime.transcription_session",
                "audio": {"input": audio_in},
            }
        return {
            "type": "realtime",
            "object": "realtime.session",
            "model": self.model,
            "instructions": self.instructions,
            "output_modalities": list(self.modalities),
            "audio": {
                "input": {
                    "format": self.input_format.as_dict(),
                    "turn_detection": detection,
                    "transcription": (
                        {"model": self.model, "language": self.language, "prompt": self.prompt}
                        if self.transcribe_input
                        else None
                    ),
                },
                "output": {"format": self.output_format.as_dict(), "voice": self.voice},
            },
            "tools": [{"type": "function", **tool["function"]} for tool in self.tools],
            "tool_choice": (
                self.tool_choice
                if isinstance(self.tool_choice, str)
                else {"type": "function", "name": self.tool_choice["function"]["name"]}
            ),
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
        }


def turn_detection(given: protocol.TurnDetection | None) -> TurnDetection | None:
    if given is None:
        return None
    fields = (
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
    )
    values = {name: value for name in fields if (value := getattr(given, name)) is not None}
    return TurnDetection(kind=given.type, **values)


def checked_modalities(modalities: Sequence[str], spoken: bool, where: str) -> tuple[str, ...]:
    if "audio" in modalities and not spoken:
        raise InvalidField(
            f"{where}.output_modalities",
            "this checkpoint has no talker, so it cannot speak: ask for ['text']",
        )
    return tuple(modalities)


def checked_voice(voice: str | protocol.VoiceId, voices: Voices, param: str) -> str:
    name = voice if isinstance(voice, str) else voice.id
    if voices.speakers:
        voices.speaker(name, param)
    return name


def tool_dict(tool: protocol.FunctionTool) -> dict[str, Any]:
    """A tool as the chat template and the tool-call parser read it (the chat API's shape)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def choice_of(choice: protocol.ToolChoice) -> str | dict[str, Any]:
    return choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
