"""Speech out over HTTP: PCM encoded as clients ask for it, the Talker's parameters from a request, a spoken
chat reply's chunks, and `/v1/audio/speech` with its bodies and stream events.

Audio is encoded with soundfile (libsndfile): wav, flac, mp3 and opus (in Ogg) as files, and pcm as raw
16-bit little-endian samples at 24 kHz mono. libsndfile has no AAC encoder, so aac is a 400 naming the
formats this server can encode. Every format holds 16-bit samples, so the samples of a wav or flac answer
equal its pcm answer, and streamed pcm chunks concatenated equal the whole answer's pcm.
"""

from __future__ import annotations

import asyncio
import base64
import io
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile
from fastapi import Request
from fastapi.responses import Response

from omnistage.errors import OmnistageError
from omnistage.outputs import AUDIO_SAMPLE_RATE, RequestOutput, TokenLogprobs
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server.errors import ErrorKind, InvalidField, error_body
from omnistage.server.formats import ChatFormat, sse
from omnistage.server.protocol.speech import SpeechRequest, VoiceRef
from omnistage.server.responses import (
    AssistantAudio,
    AssistantMessage,
    ChatChunkChoice,
    ChatDelta,
    DeltaAudio,
    Usage,
)
from omnistage.server.spoken_answers import SpokenAnswers
from omnistage.server.streaming import EventStream, Responder, failure_of, raise_if_failed
from omnistage.server.voices import Voices

PATH = "/v1/audio/speech"


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


def require_talker(voices: Voices, param: str) -> None:
    """Refuse speech (naming `param`, the field that asked for it) where the checkpoint has no voices."""
    if not voices.speakers:
        raise InvalidField(
            param, "audio output is not supported by this checkpoint: it has no talker, so it cannot speak"
        )


def speech_params(voice: str | VoiceRef, voices: Voices, param: str, talker: SamplingParams) -> SpeechParams:
    """A request's SpeechParams: its voice (`param` names the field) a speaker of the checkpoint or an alias
    of one."""
    require_talker(voices, param)
    name = voice if isinstance(voice, str) else voice.id
    return SpeechParams(voice=voices.speaker(name, param), talker=talker)


def speech_request_params(body: SpeechRequest, voices: Voices) -> SpeechParams:
    """A /v1/audio/speech request's SpeechParams, every refusal naming its field."""
    check_format(body.response_format, SPEECH_FORMATS, "response_format")
    return speech_params(body.voice, voices, "voice", body.talker_params(body.seed))


def check_reply(reply_token_ids: list[int]) -> None:
    if not reply_token_ids:
        raise InvalidField("input", "there is no text to speak: it holds no token")


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
    holds `expires_at` alone. A reply that finishes is kept in `answers` (its transcript), for a later turn
    to refer to by the audio's id until `expires_at`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        audio_format: str,
        answers: SpokenAnswers,
        fingerprint: str | None = None,
    ) -> None:
        super().__init__(request_id, model, include_usage, fingerprint)
        self.audio_format, self.answers = audio_format, answers
        self.audio_id = f"audio-{uuid.uuid4().hex}"
        self._id_sent = False
        self._transcript: list[str] = []

    def _audio_chunk(self, **fields: str | int) -> list[str]:
        if not self._id_sent:
            fields["id"], self._id_sent = self.audio_id, True
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(audio=DeltaAudio(**fields)))])]

    def opening(self) -> list[str]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant"))])]

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        # a spoken reply has no logprobs to carry: chat refuses to speak one that asks for them
        if not text:
            return []
        self._transcript.append(text)
        return self._audio_chunk(transcript=text)

    def audio(self, pcm: np.ndarray) -> list[str]:
        return self._audio_chunk(data=_b64(encode(pcm, "pcm16"))) if len(pcm) else []

    def closing(self, finish_reason: str) -> list[str]:
        expires_at = self.answers.keep(self.audio_id, "".join(self._transcript))
        return self._audio_chunk(expires_at=expires_at) + super().closing(finish_reason)

    def spoken_response(
        self, text: str, finish_reason: str, usage: Usage, audio: np.ndarray
    ) -> dict[str, Any]:
        data = _b64(encode(audio, self.audio_format))
        expires_at = self.answers.keep(self.audio_id, text)
        spoken = AssistantAudio(id=self.audio_id, data=data, expires_at=expires_at, transcript=text)
        return self.whole(AssistantMessage(content=None, audio=spoken), finish_reason, usage)


class SpeechEndpoint:
    """`/v1/audio/speech`: speak exactly `input`; the Talker reads the text's token embeddings and the
    Thinker does not run."""

    def __init__(self, responder: Responder, frontend: Frontend, voices: Voices) -> None:
        self.responder, self.frontend, self.voices = responder, frontend, voices

    async def create(self, body: SpeechRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        speech = speech_request_params(body, self.voices)
        tts = await asyncio.to_thread(self.frontend.tts_prompt, body.input)
        check_reply(tts.reply_token_ids)
        speech.reply_token_ids = tts.reply_token_ids
        # The Thinker does not run: its params need only be valid (an empty reply is the pipeline's 400).
        params = SamplingParams(max_tokens=max(1, len(tts.reply_token_ids)))
        request_id = f"speech-{uuid.uuid4().hex}"
        new = GenerationRequest(request_id, tts.token_ids, params, tts.prompt, speech=speech)
        outputs = self.responder.start(request, new)
        encoding = ENCODINGS[body.response_format]
        if body.stream_format == "sse" or encoding.format == "RAW":
            stream = SpeechStream(request_id, body.response_format, sse=body.stream_format == "sse")
            first = await self.responder.first(request, outputs, request_id)
            return EventStream(self._events(stream, outputs, first), media_type=stream.media_type)
        final = await self.responder.final(request, outputs, request_id)
        assert final.audio is not None  # a finished spoken reply has its audio (empty when it said nothing)
        data = await asyncio.to_thread(encode, final.audio, body.response_format)
        self.responder.count(PATH, 200)
        return Response(data, media_type=encoding.content_type)

    async def _events(
        self, stream: SpeechStream, outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput
    ) -> AsyncGenerator[str | bytes, None]:
        """The streamed body: audio as it is decoded, then the end `stream` writes."""
        status: int | str
        last, status = first, "cancelled"
        try:
            while True:
                if last.finished:
                    raise_if_failed(last)
                if last.audio_delta is not None:
                    for chunk in stream.audio(last.audio_delta):
                        yield chunk
                if last.finished:
                    break
                last = await anext(outputs)
            ending = await asyncio.to_thread(stream.done, len(last.prompt_token_ids), last.num_audio_frames)
            for chunk in ending:
                yield chunk
            status = 200
        except Exception as exc:  # after the 200 went out, a failure can only be told in the stream
            failure, kind = failure_of(exc, stream.id)
            status = kind.status
            for chunk in stream.failed(failure, kind):
                yield chunk
        finally:
            await self.responder.end(PATH, outputs, last, status)
