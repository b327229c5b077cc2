"""Speech out over HTTP: the formats clients ask for, the Talker's parameters from a request, a spoken chat
reply's chunks, and `/v1/audio/speech` with its bodies and stream events.

The audio itself is encoded, and time-stretched by `speed`, in audio_out.py: pcm, mp3, opus and aac go out as
the frames are decoded; wav and flac go out whole.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from omnistage.errors import OmnistageError
from omnistage.outputs import RequestOutput, TokenLogprobs
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server.audio_out import CONTENT_TYPES, FORMATS, AudioOut, encode, progressive
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

SPEECH_FORMATS = tuple(name for name in ("mp3", "opus", "aac", "flac", "wav", "pcm") if name in FORMATS)
CHAT_FORMATS = tuple(name for name in ("wav", "flac", "mp3", "opus", "aac", "pcm16") if name in FORMATS)
CHAT_STREAM_FORMATS = tuple(name for name in CHAT_FORMATS if progressive(name))


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
    streams speech; otherwise the raw audio bytes. Each piece goes out as soon as the encoder has bytes for it;
    wav and flac, held whole, go out at the end.
    """

    def __init__(self, request_id: str, response_format: str, sse: bool, speed: float = 1.0) -> None:
        self.id = request_id
        self.sse = sse
        self.media_type = "text/event-stream" if sse else CONTENT_TYPES[response_format]
        self.out = AudioOut(response_format, speed)

    async def audio(self, pcm: np.ndarray) -> list[str | bytes]:
        return self._out(await self.out.encoded(pcm)) if len(pcm) else []

    async def done(self, input_tokens: int, output_tokens: int) -> list[str | bytes]:
        """The end of a stream that succeeded: the encoder's last bytes (a whole file's all), and the usage."""
        chunks = self._out(await self.out.finished())
        if self.sse:
            usage = {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            }
            chunks.append(sse({"type": "speech.audio.done", "usage": usage}))
        return chunks

    def close(self) -> None:
        """Free the encoder, however the stream ended (a client that left, a failure, or done)."""
        self.out.close()

    def failed(self, failure: OmnistageError, kind: ErrorKind) -> list[str | bytes]:
        """An `error` event; raw audio cannot carry one, so AudioCut is raised instead."""
        if not self.sse:
            raise AudioCut(f"the audio stream of {self.id} broke off: {failure}") from failure
        return [sse({"type": "error"} | error_body(str(failure), kind))]

    def _out(self, data: bytes) -> list[str | bytes]:
        if not data:
            return []
        return [sse({"type": "speech.audio.delta", "audio": _b64(data)})] if self.sse else [data]


class SpokenChatFormat(ChatFormat):
    """A chat reply spoken as well as written (`modalities` with "audio"), in OpenAI's shape: the text is
    `message.audio.transcript` and `content` is null. Streamed, `delta.audio` carries the transcript pieces
    and the audio's bytes (pcm16, mp3, opus or aac) as the frames are decoded (the id rides on the first), and
    the last audio delta holds `expires_at` alone. A reply that finishes is kept in `answers` (its transcript), for a later turn
    to refer to by the audio's id until `expires_at`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        audio_format: str,
        answers: SpokenAnswers,
        fingerprint: str | None = None,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(request_id, model, include_usage, fingerprint, continuous_usage=continuous_usage)
        self.audio_format, self.answers = audio_format, answers
        self.audio_id = f"audio-{uuid.uuid4().hex}"
        self._id_sent = False
        self._transcript: list[str] = []
        self._out = AudioOut(audio_format)  # a streamed reply's encoder

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

    async def audio(self, pcm: np.ndarray) -> list[str]:
        return self._data(await self._out.encoded(pcm)) if len(pcm) else []

    async def audio_end(self) -> list[str]:
        return self._data(await self._out.finished())

    def release(self) -> None:
        self._out.close()

    def _data(self, data: bytes) -> list[str]:
        return self._audio_chunk(data=_b64(data)) if data else []

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
        name, speed = body.response_format, body.speed or 1.0
        streamed = body.stream_format == "sse" or progressive(name)
        outputs = self.responder.start(request, new, streamed)
        if streamed:
            stream = SpeechStream(request_id, name, body.stream_format == "sse", speed)
            first = await self.responder.first(request, outputs, request_id)
            return EventStream(self._events(stream, outputs, first), media_type=stream.media_type)
        final = await self.responder.final(request, outputs, request_id)
        assert final.audio is not None  # a finished spoken reply has its audio (empty when it said nothing)
        data = await asyncio.to_thread(encode, final.audio, name, speed)
        self.responder.count(PATH, 200)
        return Response(data, media_type=CONTENT_TYPES[name])

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
                    for chunk in await stream.audio(last.audio_delta):
                        yield chunk
                if last.finished:
                    break
                last = await anext(outputs)
            for chunk in await stream.done(len(last.prompt_token_ids), last.num_audio_frames):
                yield chunk
            status = 200
        except Exception as exc:  # after the 200 went out, a failure can only be told in the stream
            failure, kind = failure_of(exc, stream.id)
            status = kind.status
            for chunk in stream.failed(failure, kind):
                yield chunk
        finally:
            stream.close()
            await self.responder.end(PATH, outputs, last, status)
