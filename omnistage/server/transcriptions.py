"""`/v1/audio/transcriptions` and `/v1/audio/translations` as the Omni Thinker does them: one audio clip and an
instruction.

OpenAI's multipart form comes in; the clip goes into a user message beside "Transcribe the audio into
text." (plus the language when the client names it) or the instruction to translate it into English, the
client's `prompt` goes in as a system message of context, and the answer goes out as json, text,
verbose_json, srt or vtt (subtitles.py), or as `transcript.text.*` events when `stream` is set.
`include[]=logprobs` adds the reply's tokens' logprobs to a json answer (and to the events), as OpenAI's
transcription models give them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np
from fastapi import File, Form, Request, UploadFile
from fastapi.responses import PlainTextResponse, Response

from omnistage.errors import InvalidMedia
from omnistage.media import MediaPolicy, audio_seconds, load_audio
from omnistage.outputs import TokenLogprobs
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams
from omnistage.server import subtitles
from omnistage.server.errors import InvalidField
from omnistage.server.formats import DONE, sse
from omnistage.server.logprobs import LazyTokenTexts, TokenTexts, top_logprob
from omnistage.server.responses import Usage
from omnistage.server.streaming import Responder

PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
INCLUDES = ("logprobs",)
INT64 = {"ge": -(2**63), "le": 2**63 - 1}
Transcript = Callable[[str], tuple[str | None, str]]


def check_response_format(response_format: str) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise InvalidField(
            "response_format",
            f"{response_format!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
        )


def wants_logprobs(include: list[str], response_format: str) -> bool:
    """Whether `include[]` asks for logprobs (its one value OpenAI defines); they come in json answers."""
    unknown = [value for value in include if value not in INCLUDES]
    if unknown:
        raise InvalidField("include[]", f"{unknown[0]!r} is not supported; use one of {', '.join(INCLUDES)}")
    if include and response_format != "json":
        raise InvalidField(
            "include[]", f"logprobs come with response_format json only, got {response_format!r}"
        )
    return bool(include)


class TranscriptionFormat:
    """The `Format` of the transcription endpoint: OpenAI's transcription bodies and stream events.

    A stream is `transcript.text.delta` events and one `transcript.text.done` carrying the whole text and
    the token usage, as OpenAI's streamed transcriptions end. With `texts` (the request asked for logprobs),
    each delta event carries the logprobs of the tokens since the last one, and the done event all of them:
    one per token of the reply as the model wrote it (Qwen3-ASR's language header and the end token included).
    """

    include_usage = True  # the usage rides on the done event
    done = DONE
    continuous_usage = False
    running_usage: Usage | None = None

    def __init__(
        self,
        request_id: str,
        response_format: str,
        language: str | None,
        duration: float,
        transcript: Transcript = lambda text: (None, text),
        task: str = "transcribe",
        texts: TokenTexts | None = None,
    ) -> None:
        """`language`: the name of the language the client gave, if any; `transcript` reads the model's reply:
        the language it names, if any, and the text (Qwen3-ASR writes `language English<asr_text>...`; the
        Omni Thinker the text alone); `task`: verbose_json's, "transcribe" or "translate"."""
        self.id, self.task = request_id, task
        self.response_format = response_format
        self.language = (language or "unknown").lower()
        self.duration = duration
        self.transcript, self.texts = transcript, texts
        self._raw = ""
        self._text = ""
        self._logprobs: list[TokenLogprobs] = []
        self._logprobs_sent = 0

    def opening(self) -> list[str]:
        return []

    def delta(
        self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[str]:
        """The transcript's new text: the reply read so far, less what went out already (a language header is
        held back until the transcript after it begins)."""
        self._raw += text
        self._logprobs += logprobs
        _, transcript = self.transcript(self._raw)
        if not transcript.startswith(self._text) or len(transcript) == len(self._text):
            return []
        new, self._text = transcript[len(self._text) :], transcript
        event: dict[str, Any] = {"type": "transcript.text.delta", "delta": new}
        if self.texts is not None:
            event["logprobs"] = self._entries(self._logprobs[self._logprobs_sent :])
            self._logprobs_sent = len(self._logprobs)
        return [sse(event)]

    def _entries(self, logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        assert self.texts is not None  # asked for
        return [top_logprob(self.texts, lp.token_id, lp.logprob).model_dump() for lp in logprobs]

    def closing(self, finish_reason: str) -> list[str]:
        return []

    def usage_chunk(self, usage: Usage) -> str:
        tokens = {
            "type": "tokens",
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        done: dict[str, Any] = {
            "type": "transcript.text.done",
            "text": self.transcript(self._raw)[1],
            "usage": tokens,
        }
        if self.texts is not None:
            done["logprobs"] = self._entries(self._logprobs)
        return sse(done)

    def response(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Sequence[TokenLogprobs] | None = None
    ) -> dict[str, Any] | Response:
        language, text = self.transcript(text)
        if self.response_format == "text":
            return PlainTextResponse(text)
        if self.response_format == "srt":
            return PlainTextResponse(subtitles.srt(text, self.duration))
        if self.response_format == "vtt":
            return PlainTextResponse(subtitles.vtt(text, self.duration), media_type="text/vtt")
        if self.response_format == "verbose_json":
            return {
                "task": self.task,
                "language": (language or self.language).lower(),
                "duration": round(self.duration, 3),
                "text": text,
                "segments": [],
            }
        if self.texts is not None and logprobs is not None:
            return {"text": text, "logprobs": self._entries(logprobs)}
        return {"text": text}


class TranscriptionsEndpoint:
    def __init__(self, responder: Responder, frontend: Frontend, media: MediaPolicy) -> None:
        self.responder, self.frontend, self.media = responder, frontend, media
        self.texts = LazyTokenTexts(frontend)

    async def create(
        self,
        request: Request,
        file: Annotated[UploadFile, File()],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        # OpenAI's default for transcriptions.
        temperature: Annotated[float, Form(allow_inf_nan=False)] = 0.0,
        stream: Annotated[bool, Form()] = False,
        # Refused when asked for: this server has no timestamps to give. OpenAI's other form fields
        # (chunking_strategy, keywords[], languages[], known_speaker_*[]) are ignored.
        timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
        include: Annotated[list[str] | None, Form(alias="include[]")] = None,
        # Extras beyond OpenAI's form (vLLM's names), for benchmarks that force output lengths.
        max_tokens: Annotated[int | None, Form(**INT64)] = None,
        min_tokens: Annotated[int | None, Form(**INT64)] = None,
        ignore_eos: Annotated[bool | None, Form()] = None,
        seed: Annotated[int | None, Form(**INT64)] = None,
    ) -> Response:
        self.responder.begin(request, model)
        check_response_format(response_format)
        if timestamp_granularities:
            raise InvalidField("timestamp_granularities[]", "timestamps are not supported yet")
        logprobs = wants_logprobs(include or [], response_format)
        extras: dict[str, Any] = {"min_tokens": min_tokens, "ignore_eos": ignore_eos, "seed": seed}
        extras = {k: v for k, v in extras.items() if v is not None}
        data = await file.read()
        audio, laid_out = await asyncio.to_thread(self._lay_out, data, language, prompt)
        request_id = f"trsc-{uuid.uuid4().hex}"
        named = self.frontend.language_name(language)
        transcript = self.frontend.processor.transcript
        texts = self.texts.get() if logprobs else None
        fmt = TranscriptionFormat(
            request_id, response_format, named, audio_seconds(audio), transcript, texts=texts
        )
        if max_tokens is None:  # the cap of the clip's length
            max_tokens = laid_out.max_tokens
        if logprobs:
            extras["logprobs"] = 0
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **extras)
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        new = GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm)
        return await self.responder.respond(request, PATH, fmt, new, stream)

    async def translate(
        self,
        request: Request,
        file: Annotated[UploadFile, File()],
        model: Annotated[str, Form()],
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form(allow_inf_nan=False)] = 0.0,
        max_tokens: Annotated[int | None, Form(**INT64)] = None,
        min_tokens: Annotated[int | None, Form(**INT64)] = None,
        ignore_eos: Annotated[bool | None, Form()] = None,
        seed: Annotated[int | None, Form(**INT64)] = None,
    ) -> Response:
        """OpenAI's translations: the speech of `file`, in any language, as English text (no stream: OpenAI's
        translations have none)."""
        self.responder.begin(request, model)
        check_response_format(response_format)
        extras: dict[str, Any] = {"min_tokens": min_tokens, "ignore_eos": ignore_eos, "seed": seed}
        extras = {k: v for k, v in extras.items() if v is not None}
        data = await file.read()
        audio, laid_out = await asyncio.to_thread(self._lay_out, data, None, prompt, translate=True)
        request_id = f"trsl-{uuid.uuid4().hex}"
        fmt = TranscriptionFormat(
            request_id, response_format, "English", audio_seconds(audio), task="translate"
        )
        params = SamplingParams(
            max_tokens=laid_out.max_tokens if max_tokens is None else max_tokens,
            temperature=temperature,
            **extras,
        )
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        new = GenerationRequest(request_id, ids, params, laid_out.prompt, mrope, mm)
        return await self.responder.respond(request, TRANSLATIONS_PATH, fmt, new, False)

    def _lay_out(
        self, data: bytes, language: str | None, prompt: str | None, translate: bool = False
    ) -> tuple[np.ndarray, Any]:
        """The clip decoded and its transcription (or translation) prompt laid out (in a worker thread: decoding
        and tokenizing let go of the GIL for the event loop)."""
        try:
            audio = load_audio(data, self.media)
        except InvalidMedia as exc:
            raise InvalidMedia(f"file: {exc}") from None
        processor, context = self.frontend.processor, self.frontend.max_model_len
        if translate:
            return audio, processor.translation(audio, prompt, context)
        return audio, processor.transcription(audio, language, prompt, context)
