"""The OpenAI-compatible HTTP app around one AsyncEngine.

Each generation request renders and encodes its prompt, starts the engine's stream and waits for the
first output before answering, so admission errors (bad parameters, too large, queue full) still become
proper 4xx/503 responses even for `stream: true`. Rendering, tokenizing and media fetching and decoding
(`omnistage.media`) run in worker threads with calls that let go of the GIL, never on the event loop. From
then on a client that goes away, streaming or not, cancels its request: the engine stream is closed, which
aborts the request and frees its pages.
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
from fastapi import APIRouter, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from omnistage.engine.async_engine import AsyncEngine
from omnistage.engine.sampling import SamplingParams
from omnistage.errors import InvalidMedia, InvalidRequest, OmnistageError
from omnistage.media import MediaPolicy, decode_messages, load_audio
from omnistage.models.qwen3_omni.transcription import max_transcription_tokens, transcription_messages
from omnistage.outputs import RequestOutput
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
from omnistage.server.formats import DONE, ChatFormat, CompletionFormat, Format, sse
from omnistage.server.gate import DEFAULT_MAX_BODY_BYTES, Gate
from omnistage.server.metrics import ServerMetrics
from omnistage.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    invalid_text,
    may_hold_surrogates,
)
from omnistage.server.transcriptions import TranscriptionFormat, check_response_format

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
_ENDPOINTS = {CHAT, COMPLETIONS, TRANSCRIPTIONS, "/v1/models", "/health", "/metrics"}

T = TypeVar("T")
INT64 = {"ge": -(2**63), "le": 2**63 - 1}


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    media: MediaPolicy | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name`; /v1/* needs `api_key` when one is given.

    `media` says where attachments may come from (default: inline data only).
    """
    server = _Server(engine, served_model_name, media or MediaPolicy())
    app = FastAPI(title="omnistage", version=_version())
    app.state.server = server
    install_error_handlers(app, lambda request, status: server.count(request.url.path, status))
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes, on_reject=server.count)
    app.add_middleware(CatchAll, on_error=server.count)  # added last: the outermost

    v1 = APIRouter(prefix="/v1")
    for path, endpoint in (("/chat/completions", server.chat), ("/completions", server.completions)):
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
    anything else sees the body. This is the one place text from a JSON body is checked for it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if may_hold_surrogates(await request.body()):
                try:
                    data = await request.json()  # kept on the request: the handler does not parse it again
                except ValueError:
                    data = None  # not JSON: the handler reports that
                if (found := invalid_text(data)) is not None:
                    raise InvalidField(*found)
            return await handler(request)

        return checked


class _Server:
    def __init__(self, engine: AsyncEngine, served_model_name: str, media: MediaPolicy) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.media = media
        self.metrics = ServerMetrics()
        self.created = int(time.time())

    def count(self, path: str, status: int | str) -> None:
        endpoint = path if path in _ENDPOINTS else "other"
        self.metrics.count(endpoint, "cancelled" if status == 499 else status)

    # -- endpoints ----------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.sampling_params(body.requested_max_tokens)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.served_model_name, body.include_usage)
        work = self._process_media_chat if body.has_media() else self._encode_chat
        prompt = await asyncio.to_thread(work, body.message_dicts(), body.add_generation_prompt)
        return await self._generate(request, CHAT, fmt, prompt, params, bool(body.stream))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.sampling_params(body.max_tokens)
        given = body.single_prompt()
        if isinstance(given, str):
            processor, context = self.engine.engine.processor, self.engine.engine.max_model_len
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
        fmt = TranscriptionFormat.for_audio(f"trsc-{uuid.uuid4().hex}", response_format, language, audio)
        if max_tokens is None:
            max_tokens = max_transcription_tokens(fmt.duration)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **extras)
        return await self._generate(request, TRANSCRIPTIONS, fmt, processed, params, stream)

    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    async def model(self, model: str) -> ModelCard:
        self._check_model(model)
        return self._card()

    async def health(self) -> JSONResponse:
        if self.engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_text(self) -> Response:
        text = self.metrics.render(self.engine.stats())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- the shared path ----------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ModelNotFound(
                f"the model '{name}' does not exist; this server serves '{self.served_model_name}'"
            )

    def _card(self) -> ModelCard:
        return ModelCard(
            id=self.served_model_name,
            created=self.created,
            root=str(self.engine.engine.model_path),
            max_model_len=self.engine.engine.max_model_len,
        )

    # These run in worker threads: fetching, decoding and tokenizing let go of the GIL for the event loop.

    def _process_media_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> Any:
        """Fetch and decode the attachments, then let the processor lay out the multimodal prompt."""
        decoded = decode_messages(messages, self.media)
        engine = self.engine.engine
        try:
            return engine.processor.process_chat(decoded, add_generation_prompt, engine.max_model_len)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the chat template rejected them ({exc})") from None

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> _Prompt:
        engine = self.engine.engine
        try:
            prompt, ids = engine.processor.encode_chat(messages, add_generation_prompt, engine.max_model_len)
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
        messages = transcription_messages(audio, language, prompt)
        engine = self.engine.engine
        return audio, engine.processor.process_chat(messages, True, engine.max_model_len)

    async def _generate(
        self,
        request: Request,
        endpoint: str,
        fmt: Format,
        prompt: _Prompt | Any,
        params: SamplingParams,
        stream: bool,
    ) -> Response:
        """Run one request; `prompt` is a _Prompt or the processor's ProcessedPrompt (with mrope and mm)."""
        media = {k: v for k in ("mrope", "mm") if (v := getattr(prompt, k, None)) is not None}
        outputs = self.engine.generate(fmt.id, prompt.prompt, prompt.token_ids, params, **media)
        if stream:
            # Wait for the first output so that admission errors still get their status code.
            first = await _engine_call(_unless_disconnected(request, anext(outputs)), outputs, fmt.id)
            return _EventStream(self._events(endpoint, fmt, outputs, first))

        seen: list[RequestOutput] = []

        async def collect() -> RequestOutput:
            async for output in outputs:
                seen.append(output)
            return seen[-1]

        try:
            final = await _engine_call(_unless_disconnected(request, collect()), outputs, fmt.id)
        finally:
            if seen:
                self.metrics.observe(seen[-1])
        completion = final.outputs[0]
        _raise_if_failed(final)
        usage = Usage.of(len(final.prompt_token_ids), len(completion.token_ids))
        self.count(endpoint, 200)
        body = fmt.response(completion.text, completion.finish_reason, usage)
        return body if isinstance(body, Response) else JSONResponse(body)

    async def _events(
        self, endpoint: str, fmt: Format, outputs: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[str]:
        """The SSE body: opening chunk, deltas, the finishing chunk, usage if asked, then [DONE]."""
        last, status = first, "cancelled"
        try:
            for chunk in fmt.opening():
                yield chunk
            while True:
                completion = last.outputs[0]
                if last.finished:
                    break
                for chunk in fmt.delta(completion.delta_text, None):
                    yield chunk
                last = await anext(outputs)
            _raise_if_failed(last)
            for chunk in fmt.delta(completion.delta_text, completion.finish_reason):
                yield chunk
            for chunk in fmt.closing(completion.finish_reason):
                yield chunk
            if fmt.include_usage:
                yield fmt.usage_chunk(Usage.of(len(last.prompt_token_ids), len(completion.token_ids)))
            yield DONE
            status = 200
        except Exception as exc:  # after the 200 went out, a failure can only be told in the stream
            failure = _typed(exc, fmt.id)
            kind = kind_of(failure)
            status = kind.status
            yield sse(error_body(str(failure), kind))
            yield DONE
        finally:
            await outputs.aclose()
            self.count(endpoint, status)
            self.metrics.observe(last)


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


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed, so a client that leaves aborts its request.

    Starlette cancels the sending task on disconnect but leaves the generator suspended; closing it here
    runs its `finally`, which closes the engine stream at once instead of whenever it is collected.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        # No caching, and no buffering by a proxy (nginx honours X-Accel-Buffering): each event goes out at once.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
