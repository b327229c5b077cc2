"""The OpenAI-compatible HTTP app around one AsyncPipeline.

Each generation request renders and encodes its prompt, starts the engine's stream and waits for the
first output before answering, so admission errors (bad parameters, too large, queue full) still become
proper 4xx/503 responses even for `stream: true`. Rendering, tokenizing and media fetching and decoding
(`omnistage.media`) run in worker threads with calls that let go of the GIL, never on the event loop. From
then on a client that goes away, streaming or not, cancels its request: the engine stream is closed, which
aborts the request and frees its pages.

A request asking for audio (chat with `modalities` "audio", or `/v1/audio/speech`) speaks through the
engine's Talker; `omnistage.server.speech` encodes the audio and spells its chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, TypeVar

import jinja2
import pydantic_core
from fastapi import APIRouter, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

from omnistage.errors import InvalidMedia, InvalidRequest, OmnistageError
from omnistage.media import MediaPolicy, audio_seconds, decode_messages, load_audio
from omnistage.outputs import RequestOutput
from omnistage.pipeline.async_pipeline import AsyncPipeline, Preparing
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server.errors import (
    CatchAll,
    ClientGone,
    EngineFailure,
    InvalidField,
    ModelNotFound,
    error_body,
    install_error_handlers,
    kind_of,
)
from omnistage.server.formats import DONE, ChatFormat, CompletionFormat, Format, SpeakingFormat, sse
from omnistage.server.gate import DEFAULT_MAX_BODY_BYTES, Gate
from omnistage.server.metrics import ServerMetrics
from omnistage.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SpeechRequest,
    invalid_text,
    may_hold_surrogates,
)
from omnistage.server.responses import ModelCard, ModelList, Usage
from omnistage.server.speech import (
    ENCODINGS,
    SpeechStream,
    SpokenChatFormat,
    chat_speech_params,
    check_reply,
    encode,
    speech_request_params,
)
from omnistage.server.transcriptions import TranscriptionFormat, check_response_format

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
SPEECH = "/v1/audio/speech"
_ENDPOINTS = {CHAT, COMPLETIONS, TRANSCRIPTIONS, SPEECH, "/v1/models", "/health", "/metrics"}

T = TypeVar("T")
INT64 = {"ge": -(2**63), "le": 2**63 - 1}


def build_app(
    pipeline: AsyncPipeline,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    media: MediaPolicy | None = None,
) -> FastAPI:
    """The FastAPI app serving `pipeline` under `served_model_name`; /v1/* needs `api_key` when one is given.

    `media` says where attachments may come from (default: inline data only).
    """
    server = _Server(pipeline, served_model_name, media or MediaPolicy())
    app = FastAPI(title="omnistage", version=_version())
    app.state.server = server
    install_error_handlers(app, lambda request, status: server.count(request.url.path, status))
    app.add_middleware(
        Gate,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_reject=server.count,
        preparing=pipeline.preparing,
        preparing_paths=frozenset({CHAT, COMPLETIONS, TRANSCRIPTIONS, SPEECH}),
    )
    app.add_middleware(CatchAll, on_error=server.count)  # added last: the outermost

    v1 = APIRouter(prefix="/v1")
    json_routes = (
        ("/chat/completions", server.chat),
        ("/completions", server.completions),
        ("/audio/speech", server.speech),
    )
    for path, endpoint in json_routes:
        v1.add_api_route(
            path, endpoint, methods=["POST"], response_model=None, route_class_override=_JSONRoute
        )
    v1.add_api_route("/audio/transcriptions", server.transcriptions, methods=["POST"], response_model=None)
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", server.model, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    return app


def _version() -> str:
    try:
        return version("omnistage")
    except PackageNotFoundError:
        return "0+unknown"


class _JSONRoute(APIRoute):
    """A JSON route whose body may hold only valid Unicode: a JSON escape of a lone surrogate ("\\ud800"),
    which json.loads accepts but no tokenizer or response can encode, is a 400 naming its field, before
    anything else sees the body. This is the one place text from a JSON body is checked for it.

    A body without any is parsed by pydantic-core's JSON parser, ten times json.loads' speed on a clip's
    body (16 against 165 µs for 300 KB on the CPU machine, on the event loop), and kept where Starlette keeps
    a parsed body, so that FastAPI does not parse it again; it gives the same values as json.loads for any
    JSON it accepts, and whatever it refuses (invalid JSON, a byte-order mark, nesting beyond its limit) is
    left to FastAPI's json.loads and its errors, as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if may_hold_surrogates(body):
                try:
                    data = await request.json()  # kept on the request: the handler does not parse it again
                except ValueError:
                    data = None  # not JSON: the handler reports that
                if (found := invalid_text(data)) is not None:
                    raise InvalidField(*found)
            else:
                try:
                    request._json = pydantic_core.from_json(body)  # Request.json()'s own cache
                except ValueError:
                    pass
            return await handler(request)

        return checked


class _Server:
    def __init__(self, pipeline: AsyncPipeline, served_model_name: str, media: MediaPolicy) -> None:
        self.pipeline = pipeline
        self.served_model_name = served_model_name
        self.media = media
        self.metrics = ServerMetrics()
        self.frontend = pipeline.frontend
        self.metrics.set_plan(self.frontend)
        self.created = int(time.time())

    def count(self, path: str, status: int | str) -> None:
        endpoint = path if path in _ENDPOINTS else "other"
        self.metrics.count(endpoint, "cancelled" if status == 499 else status)

    # -- endpoints ----------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._parsed(request)
        self._check_model(body.model)
        speech = chat_speech_params(body, self.frontend.voices)
        params = body.sampling_params(body.requested_max_tokens)
        request_id, name = f"chatcmpl-{uuid.uuid4().hex}", self.served_model_name
        fmt: Format = ChatFormat(request_id, name, body.include_usage)
        if speech is not None and body.audio is not None:
            fmt = SpokenChatFormat(request_id, name, body.include_usage, body.audio.format)
        work = self._process_media_chat if body.has_media() else self._encode_chat
        prompt = await asyncio.to_thread(work, body.message_dicts(), body.add_generation_prompt)
        if params.max_tokens is None:  # a chat to Qwen3-ASR is capped as its clip's transcription is
            params.max_tokens = getattr(prompt, "max_tokens", None)
        return await self._generate(request, CHAT, fmt, prompt, params, bool(body.stream), speech)

    async def speech(self, body: SpeechRequest, request: Request) -> Response:
        """Speak exactly `input`: the Talker reads the text's token embeddings; the Thinker does not run."""
        self._parsed(request)
        self._check_model(body.model)
        frontend = self.frontend
        speech = speech_request_params(body, frontend.voices)
        tts = await asyncio.to_thread(frontend.tts_prompt, body.input)
        check_reply(tts.reply_token_ids)
        speech.reply_token_ids = tts.reply_token_ids
        # The Thinker does not run: its params need only be valid (an empty reply is the pipeline's 400).
        params = SamplingParams(max_tokens=max(1, len(tts.reply_token_ids)))
        request_id = f"speech-{uuid.uuid4().hex}"
        spoken = GenerationRequest(request_id, tts.token_ids, params, tts.prompt, speech=speech)
        outputs = self.pipeline.generate(spoken, self._handing_over(request))
        encoding = ENCODINGS[body.response_format]
        if body.stream_format == "sse" or encoding.format == "RAW":
            stream = SpeechStream(request_id, body.response_format, sse=body.stream_format == "sse")
            first = await _engine_call(_unless_disconnected(request, anext(outputs)), outputs, request_id)
            return _Stream(self._speech_events(stream, outputs, first), media_type=stream.media_type)
        final = await self._final(request, outputs, request_id)
        data = await asyncio.to_thread(encode, final.audio, body.response_format)
        self.count(SPEECH, 200)
        return Response(data, media_type=encoding.content_type)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._parsed(request)
        self._check_model(body.model)
        params = body.sampling_params(body.max_tokens)
        given = body.single_prompt()
        if isinstance(given, str):
            processor, context = self.frontend.processor, self.frontend.max_model_len
            prompt = _Prompt(given, await asyncio.to_thread(processor.encode, given, context))
        else:
            prompt = _Prompt(None, list(given))
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.served_model_name, body.include_usage)
        return await self._generate(request, COMPLETIONS, fmt, prompt, params, bool(body.stream))

    async def transcriptions(
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
        # Refused when asked for: this server has no timestamps and no logprobs to give. OpenAI's other
        # form fields (chunking_strategy, keywords[], languages[], known_speaker_*[]) are ignored.
        timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
        include: Annotated[list[str] | None, Form(alias="include[]")] = None,
        # Extras beyond OpenAI's form (vLLM's names), for benchmarks that force output lengths.
        max_tokens: Annotated[int | None, Form(**INT64)] = None,
        min_tokens: Annotated[int | None, Form(**INT64)] = None,
        ignore_eos: Annotated[bool | None, Form()] = None,
        seed: Annotated[int | None, Form(**INT64)] = None,
    ) -> Response:
        self._parsed(request)
        self._check_model(model)
        check_response_format(response_format)
        if timestamp_granularities:
            raise InvalidField("timestamp_granularities[]", "timestamps are not supported yet")
        if include:
            raise InvalidField("include[]", "logprobs are not supported yet")
        extras = {"min_tokens": min_tokens, "ignore_eos": ignore_eos, "seed": seed}
        extras = {k: v for k, v in extras.items() if v is not None}
        data = await file.read()
        audio, processed = await asyncio.to_thread(self._process_transcription, data, language, prompt)
        named = self.frontend.language_name(language)
        transcript = self.frontend.processor.transcript
        fmt = TranscriptionFormat(
            f"trsc-{uuid.uuid4().hex}", response_format, named, audio_seconds(audio), transcript
        )
        if max_tokens is None:  # the cap of the clip's length
            max_tokens = processed.max_tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **extras)
        return await self._generate(request, TRANSCRIPTIONS, fmt, processed, params, stream)

    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    async def model(self, model: str) -> ModelCard:
        self._check_model(model)
        return self._card()

    async def health(self) -> JSONResponse:
        if self.pipeline.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_text(self) -> Response:
        text = self.metrics.render(self.pipeline.stats())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- the shared path ----------------------------------------------------------------------------

    def _parsed(self, request: Request) -> None:
        """The request's body is parsed and validated (its handler starts): the parse phase ends."""
        state = request.state
        self.metrics.parsed(getattr(state, "arrived", None), getattr(state, "received", None))

    def _handing_over(self, request: Request) -> Preparing | None:
        """The request is prepared: its prepare phase ends; returns its count among the requests being prepared,
        for `generate` to end as it hands the request over (gate.py)."""
        self.metrics.prepared(getattr(request.state, "received", None))
        return getattr(request.state, "preparing", None)

    def _check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ModelNotFound(
                f"the model '{name}' does not exist; this server serves '{self.served_model_name}'"
            )

    def _card(self) -> ModelCard:
        return ModelCard(
            id=self.served_model_name,
            created=self.created,
            root=str(self.frontend.model_path),
            max_model_len=self.frontend.max_model_len,
        )

    # These run in worker threads: fetching, decoding and tokenizing let go of the GIL for the event loop.

    def _process_media_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> Any:
        """Fetch and decode the attachments, then let the processor lay out the multimodal prompt."""
        decoded = decode_messages(messages, self.media)
        frontend = self.frontend
        try:
            return frontend.processor.process_chat(decoded, add_generation_prompt, frontend.max_model_len)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the chat template rejected them ({exc})") from None

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> _Prompt:
        frontend = self.frontend
        try:
            prompt, ids = frontend.processor.encode_chat(
                messages, add_generation_prompt, frontend.max_model_len
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the chat template rejected them ({exc})") from None
        return _Prompt(prompt, ids)

    def _process_transcription(
        self, data: bytes, language: str | None, prompt: str | None
    ) -> tuple[Any, Any]:
        try:
            audio = load_audio(data, self.media)
        except InvalidMedia as exc:
            raise InvalidMedia(f"file: {exc}") from None
        frontend = self.frontend
        return audio, frontend.processor.transcription(audio, language, prompt, frontend.max_model_len)

    async def _generate(
        self,
        request: Request,
        endpoint: str,
        fmt: Format,
        prompt: _Prompt | Any,
        params: SamplingParams,
        stream: bool,
        speech: SpeechParams | None = None,
    ) -> Response:
        """Run one request; `prompt` is a _Prompt or the processor's ProcessedPrompt (with mrope and mm).

        With `speech` the reply is spoken too, and `fmt` is a SpeakingFormat."""
        mrope, mm = getattr(prompt, "mrope", None), getattr(prompt, "mm", None)
        new = GenerationRequest(fmt.id, prompt.token_ids, params, prompt.prompt, mrope, mm, speech)
        outputs = self.pipeline.generate(new, self._handing_over(request))
        if stream:
            # Wait for the first output so that admission errors still get their status code.
            first = await _engine_call(_unless_disconnected(request, anext(outputs)), outputs, fmt.id)
            delivered = first.metrics.get("delivered")
            return _Stream(
                self._events(endpoint, fmt, outputs, first), lambda: self.metrics.responded(delivered)
            )
        final = await self._final(request, outputs, fmt.id)
        text, reason = final.outputs[0].text, final.outputs[0].finish_reason
        if isinstance(fmt, SpeakingFormat):
            usage = _usage(final, spoken=True)
            body = await asyncio.to_thread(fmt.spoken_response, text, reason, usage, final.audio)
        else:
            body = fmt.response(text, reason, _usage(final, spoken=False))
        self.count(endpoint, 200)
        return body if isinstance(body, Response) else JSONResponse(body)

    async def _final(
        self, request: Request, outputs: AsyncIterator[RequestOutput], request_id: str
    ) -> RequestOutput:
        """The request's finished output (raising if it failed), once the engine is done with it."""
        seen: list[RequestOutput] = []  # the latest only: a spoken reply's earlier ones hold its audio chunks

        async def collect() -> RequestOutput:
            async for output in outputs:
                seen[:] = [output]
            return seen[-1]

        try:
            final = await _engine_call(_unless_disconnected(request, collect()), outputs, request_id)
        finally:
            if seen:
                self.metrics.observe(seen[-1])
        _raise_if_failed(final)
        return final

    async def _events(
        self, endpoint: str, fmt: Format, outputs: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[str]:
        """The SSE body: opening chunk, deltas (text, and audio when spoken), the finishing chunk, usage if
        asked, then [DONE].

        The chunks of one engine output go out as one string: each yield is a send through every middleware
        and a socket write. `pending` holds those not yet yielded, so a failure sends them before its error.
        """
        last, status = first, "cancelled"
        spoken = fmt if isinstance(fmt, SpeakingFormat) else None
        pending: list[str] = []
        try:
            pending += fmt.opening()
            while True:
                completion = last.outputs[0]
                if last.finished:
                    break
                pending += fmt.delta(completion.delta_text, None)
                pending += _audio_chunks(spoken, last)
                if pending:
                    body, pending = "".join(pending), []
                    yield body
                last = await anext(outputs)
            _raise_if_failed(last)
            pending += fmt.delta(completion.delta_text, completion.finish_reason)
            pending += _audio_chunks(spoken, last)
            pending += fmt.closing(completion.finish_reason)
            if fmt.include_usage:
                pending.append(fmt.usage_chunk(_usage(last, spoken=spoken is not None)))
            body, pending = "".join([*pending, DONE]), []
            yield body
            status = 200
        except Exception as exc:  # after the 200 went out, a failure can only be told in the stream
            failure = _typed(exc, fmt.id)
            kind = kind_of(failure)
            status = kind.status
            yield "".join([*pending, sse(error_body(str(failure), kind)), DONE])
        finally:
            await outputs.aclose()
            self.count(endpoint, status)
            self.metrics.observe(last)

    async def _speech_events(
        self, stream: SpeechStream, outputs: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[str | bytes]:
        """The streamed body of /v1/audio/speech: audio as it is decoded, then the end `stream` writes."""
        last, status = first, "cancelled"
        try:
            while True:
                if last.finished:
                    _raise_if_failed(last)
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
            failure = _typed(exc, stream.id)
            kind = kind_of(failure)
            status = kind.status
            for chunk in stream.failed(failure, kind):
                yield chunk
        finally:
            await outputs.aclose()
            self.count(SPEECH, status)
            self.metrics.observe(last)


def _usage(output: RequestOutput, spoken: bool) -> Usage:
    """Prompt and generated tokens; a spoken reply's codec frames count as its audio tokens."""
    audio_tokens = output.num_audio_frames if spoken else None
    return Usage.of(len(output.prompt_token_ids), len(output.outputs[0].token_ids), audio_tokens)


def _audio_chunks(fmt: SpeakingFormat | None, output: RequestOutput) -> list[str]:
    if fmt is None or output.audio_delta is None:
        return []
    return fmt.audio(output.audio_delta)


@dataclass(frozen=True)
class _Prompt:
    """A text prompt, shaped like the processor's ProcessedPrompt without media."""

    prompt: str | None
    token_ids: list[int]


def _raise_if_failed(output: RequestOutput) -> None:
    reason = output.outputs[0].finish_reason
    if reason == "error":
        raise EngineFailure(f"the engine failed this request: {output.error or 'unknown error'}")
    if reason == "abort":
        raise EngineFailure("the engine aborted this request")


async def _engine_call(call: Awaitable[T], outputs: AsyncIterator[RequestOutput], request_id: str) -> T:
    """Await an engine call; anything but our typed errors becomes an EngineFailure (500) for this request.

    On any failure the engine stream is closed, so nothing of the request stays behind.
    """
    try:
        return await call
    except BaseException as exc:
        await outputs.aclose()
        if isinstance(exc, OmnistageError) or not isinstance(exc, Exception):
            raise
        raise _typed(exc, request_id) from exc


def _typed(exc: Exception, request_id: str) -> OmnistageError:
    """Our typed errors as they are; anything else is this request's EngineFailure, logged with its trace."""
    if isinstance(exc, OmnistageError):
        return exc
    if isinstance(exc, StopAsyncIteration):
        return EngineFailure("the engine ended this request without a final output")
    log.error("request %s failed in the engine", request_id, exc_info=exc)
    return EngineFailure(f"the engine failed this request: {exc}")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # cancelling the engine stream's pending step aborts the request
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the channel's next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Stream(StreamingResponse):
    """A streamed body (server-sent events, or raw audio) that stops as soon as its client leaves, and whose
    generator is always closed, so a client that leaves aborts its request.

    Under uvicorn (ASGI 2.3) Starlette streams in a task group beside a task listening for the disconnect,
    which cost a stream ~1 ms of the event loop before its first chunk (the respond phase at c=1 on the CPU
    machine). Here the response streams in its own task, and one task waits for the disconnect and cancels it.
    Closing the generator at the end runs its `finally`, which closes the engine stream at once instead of
    whenever it is collected.
    """

    def __init__(
        self,
        chunks: AsyncIterator[Any],
        on_first_chunk: Callable[[], None] | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        # No caching, and no buffering by a proxy (nginx honours X-Accel-Buffering): each chunk goes out at once.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(chunks, media_type=media_type, headers=headers)
        self.on_first_chunk = on_first_chunk  # called once the first chunk of the body is written

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        over, left = False, False
        pending = self.on_first_chunk

        async def sending(message: Message) -> None:
            nonlocal pending
            await send(message)
            if pending is not None and message["type"] == "http.response.body":
                pending, told = None, pending
                told()

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            if not over:  # the stream is suspended mid-body (this task runs only then): stop it there
                left = True
                streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(sending)
        except asyncio.CancelledError:
            if not left:
                raise
            streaming.uncancel()  # the client left: the response simply ends
        finally:
            over = True
            watcher.cancel()
            await self.body_iterator.aclose()
