"""Speech out over HTTP: PCM encoded as clients ask for it, the Talker's parameters from a request, and the
bodies and stream events of `/v1/audio/speech`.

Audio is encoded with soundfile (libsndfile): wav, flac, mp3 and opus (in Ogg) as files, and pcm as raw
16-bit little-endian samples at 24 kHz mono. libsndfile has no AAC encoder, so aac is a 400 naming the
formats this server can encode. Every format holds 16-bit samples, so the samples of a wav or flac answer
equal its pcm answer, and streamed pcm chunks concatenated equal the whole answer's pcm.
"""

from __future__ import annotations

import base64
import io
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile

from omnistage.errors import OmnistageError
from omnistage.outputs import AUDIO_SAMPLE_RATE
from omnistage.request import SamplingParams, SpeechParams
from omnistage.server.errors import ErrorKind, InvalidField, error_body
from omnistage.server.formats import ChatFormat, sse
from omnistage.server.protocol import ChatCompletionRequest, SpeechRequest, VoiceRef
from omnistage.server.responses import (
    AssistantAudio,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionResponse,
    ChatDelta,
    DeltaAudio,
    Usage,
)


@dataclass(frozen=True)
class Encoding:
    format: str  # libsndfile's major format
    subtype: str
    content_type: str


# Chat's `audio.format` says pcm16 where /v1/audio/speech says pcm; both are the same raw samples.
_ENCODINGS = {
    "wav": Encoding("WAV", "PCM_16", "audio/wav"),
    "flac": Encoding("FLAC", "PCM_16", "audio/flac"),
    "mp3": Encoding("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": Encoding("OGG", "OPUS", "audio/ogg"),
    "pcm": Encoding("RAW", "PCM_16", "audio/pcm"),
    "pcm16": Encoding("RAW", "PCM_16", "audio/pcm"),
}
# libsndfile builds without mp3 or opus exist (before 1.1.0, or built without them): offer what this one has.
ENCODINGS = {name: enc for name, enc in _ENCODINGS.items() if soundfile.check_format(enc.format, enc.subtype)}
SPEECH_FORMATS = tuple(name for name in ("mp3", "opus", "flac", "wav", "pcm") if name in ENCODINGS)
CHAT_FORMATS = tuple(name for name in ("wav", "flac", "mp3", "opus", "pcm16") if name in ENCODINGS)


def encode(pcm: np.ndarray, name: str) -> bytes:
    """float32 mono PCM at 24 kHz as the bytes of format `name` (samples beyond [-1, 1] are clipped)."""
    enc = ENCODINGS[name]
    # Quantized here, once: libsndfile rounds floats differently per format (flac and wav differ by one
    # step), and every lossless answer must hold the same samples as the pcm one.
    samples = np.clip(np.rint(pcm * 32768.0), -32768, 32767).astype(np.int16)
    buffer = io.BytesIO()
    endian = "LITTLE" if enc.format == "RAW" else "FILE"
    soundfile.write(buffer, samples, AUDIO_SAMPLE_RATE, subtype=enc.subtype, endian=endian, format=enc.format)
    return buffer.getvalue()


def check_format(name: str, supported: tuple[str, ...], param: str) -> str:
    if name not in supported:
        raise InvalidField(param, f"{name!r} is not supported; this server encodes {', '.join(supported)}")
    return name


def require_talker(voices: tuple[str, ...], param: str) -> None:
    """Refuse speech (naming `param`, the field that asked for it) where the checkpoint has no voices."""
    if not voices:
        raise InvalidField(
            param, "audio output is not supported by this checkpoint: it has no talker, so it cannot speak"
        )


def speech_params(
    voice: str | VoiceRef, voices: tuple[str, ...], param: str, talker: SamplingParams
) -> SpeechParams:
    """A request's SpeechParams: its voice (`param` names the field) checked against the checkpoint's."""
    require_talker(voices, param)
    name = voice if isinstance(voice, str) else voice.id
    if name.lower() not in voices:
        raise InvalidField(param, f"unknown voice {name!r}; this model speaks with {', '.join(voices)}")
    return SpeechParams(voice=name.lower(), talker=talker)


def speech_request_params(body: SpeechRequest, voices: tuple[str, ...]) -> SpeechParams:
    """A /v1/audio/speech request's SpeechParams, every refusal naming its field."""
    check_format(body.response_format, SPEECH_FORMATS, "response_format")
    return speech_params(body.voice, voices, "voice", body.talker_params(body.seed))


def check_reply(reply_token_ids: list[int]) -> None:
    if not reply_token_ids:
        raise InvalidField("input", "there is no text to speak: it holds no token")


def chat_speech_params(body: ChatCompletionRequest, voices: tuple[str, ...]) -> SpeechParams | None:
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


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class AudioCut(Exception):
    """Raised out of a raw audio body that failed after its first bytes went out. It is none of the errors
    mapped to a response (too late for one): the server closes the connection, the one way left to tell the
    client that the audio is incomplete."""


class SpeechStream:
    """The streamed body of `/v1/audio/speech`.

    `sse`: `speech.audio.delta` events (base64 audio) and one `speech.audio.done` with the usage, as OpenAI
    streams speech; otherwise the raw audio bytes. pcm goes out chunk by chunk as the frames are decoded;
    a file format needs the whole audio (its header holds the length), so it goes out once, at the end.
    """

    def __init__(self, request_id: str, response_format: str, sse: bool) -> None:
        self.id = request_id
        self.response_format = response_format
        self.sse = sse
        self.media_type = "text/event-stream" if sse else ENCODINGS[response_format].content_type
        self._chunked = ENCODINGS[response_format].format == "RAW"
        self._held: list[np.ndarray] = []

    def audio(self, pcm: np.ndarray) -> list[str | bytes]:
        if not self._chunked:
            self._held.append(pcm)
            return []
        return self._out(encode(pcm, self.response_format)) if len(pcm) else []

    def done(self, input_tokens: int, output_tokens: int) -> list[str | bytes]:
        """The end of a stream that succeeded (a file format's whole audio comes first). Runs in a worker
        thread: encoding a file takes a while."""
        chunks: list[str | bytes] = []
        if not self._chunked:
            held = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
            chunks += self._out(encode(held, self.response_format))
        if self.sse:
            usage = {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            }
            chunks.append(sse({"type": "speech.audio.done", "usage": usage}))
        return chunks

    def failed(self, failure: OmnistageError, kind: ErrorKind) -> list[str | bytes]:
        """An `error` event; raw audio cannot carry one, so AudioCut is raised instead."""
        if not self.sse:
            raise AudioCut(f"the audio stream of {self.id} broke off: {failure}") from failure
        return [sse({"type": "error"} | error_body(str(failure), kind))]

    def _out(self, data: bytes) -> list[str | bytes]:
        return [sse({"type": "speech.audio.delta", "audio": _b64(data)})] if self.sse else [data]


class SpokenChatFormat(ChatFormat):
    """A chat reply spoken as well as written (`modalities` with "audio"), in OpenAI's shape: the text is
    `message.audio.transcript` and `content` is null. Streamed, `delta.audio` carries the transcript pieces
    and the pcm16 chunks as the frames are decoded (the id rides on the first), and the last audio delta
    holds `expires_at` alone."""

    def __init__(self, request_id: str, model: str, include_usage: bool, audio_format: str) -> None:
        super().__init__(request_id, model, include_usage)
        self.audio_format = audio_format
        self.audio_id = f"audio-{uuid.uuid4().hex}"
        self._id_sent = False

    def _audio_chunk(self, **fields: str | int) -> list[str]:
        if not self._id_sent:
            fields["id"], self._id_sent = self.audio_id, True
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(audio=DeltaAudio(**fields)))])]

    def opening(self) -> list[str]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant"))])]

    def delta(self, text: str, finish_reason: str | None) -> list[str]:
        return self._audio_chunk(transcript=text) if text else []

    def audio(self, pcm: np.ndarray) -> list[str]:
        return self._audio_chunk(data=_b64(encode(pcm, "pcm16"))) if len(pcm) else []

    def closing(self, finish_reason: str) -> list[str]:
        return self._audio_chunk(expires_at=self.created) + super().closing(finish_reason)

    def spoken_response(
        self, text: str, finish_reason: str, usage: Usage, audio: np.ndarray
    ) -> dict[str, Any]:
        data = _b64(encode(audio, self.audio_format))
        spoken = AssistantAudio(id=self.audio_id, data=data, expires_at=self.created, transcript=text)
        choice = ChatChoice(message=AssistantMessage(content=None, audio=spoken), finish_reason=finish_reason)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        ).model_dump()
