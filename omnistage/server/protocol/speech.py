"""The protocol's speech: a voice by name or object, this server's Talker fields (`max_frames`, sampling over
the released defaults), chat's `audio` and `/v1/audio/speech`'s body."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from omnistage.request import MAX_AUDIO_FRAMES, SamplingParams, talker_sampling_defaults
from omnistage.server.errors import InvalidField
from omnistage.server.protocol.base import Int64, Strict, with_fields

# OpenAI documents 4,096 characters as the most /v1/audio/speech speaks in one request.
MAX_SPEECH_INPUT = 4096
# OpenAI's bounds on the speed of /v1/audio/speech
MIN_SPEED, MAX_SPEED = 0.25, 4.0


class VoiceRef(Strict):
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


class TalkerFields(Strict):
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
        given: dict[str, Any] = {
            name: value
            for name in ("temperature", "top_p", "top_k", "repetition_penalty", "ignore_eos")
            if (value := getattr(self, name)) is not None
        }
        if self.min_frames is not None:
            given["min_tokens"] = self.min_frames
        base = replace(talker_sampling_defaults(), max_tokens=self.max_frames, seed=seed)
        return with_fields(
            base, given, lambda name: prefix + _TALKER_FIELD.get(name, name), f"{prefix}min_frames"
        )


# SamplingParams' names of the request's fields, where they differ
_TALKER_FIELD = {"min_tokens": "min_frames"}


class ChatAudioParams(TalkerFields):
    """A chat request's `audio`: OpenAI's voice and format, and the Talker's controls."""

    voice: Voice
    format: str  # checked against what this server can encode, so an unknown one is a 400 naming those


class SpeechRequest(TalkerFields):
    """`/v1/audio/speech`: speak exactly `input`."""

    model: str
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT)
    voice: Voice
    response_format: str = "mp3"  # OpenAI's default; checked against what this server can encode
    stream_format: Literal["audio", "sse"] = "audio"
    # OpenAI's range; FFmpeg's atempo stretches the audio to it, pitch kept (audio_out.py)
    speed: Annotated[float, Field(ge=MIN_SPEED, le=MAX_SPEED)] | None = None
    # Clients send it when configured; these voices have no style control, so it is accepted and not applied.
    instructions: str | None = None
    seed: Int64 | None = None  # this server's: seeds the Talker and the code predictor
    user: str | None = None  # OpenAI's end-user tag: ignored
