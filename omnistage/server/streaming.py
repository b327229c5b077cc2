"""A request's run through the pipeline, answered whole or streamed, and the stream plumbing beneath.

Every generating endpoint builds its GenerationRequest and its Format and hands them to `Responder.respond`,
which starts the pipeline's stream and waits for the first output before answering, so that admission errors
(bad parameters, too large, queue full) still become proper 4xx/503 responses even for `stream: true`. From
then on a client that goes away, streaming or not, cancels its request: the stream is closed, which aborts the
request and frees its pages. After the 200 went out, a failure can only be told in the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from omnistage.errors import OmnistageError
from omnistage.outputs import RequestOutput
from omnistage.pipeline.async_pipeline import AsyncPipeline, Preparing
from omnistage.request import GenerationRequest
from omnistage.server.errors import ClientGone, EngineFailure, ErrorKind, ModelNotFound, error_body, kind_of
from omnistage.server.formats import Format, SpeakingFormat, sse
from omnistage.server.metrics import ServerMetrics
from omnistage.server.responses import Usage

log = logging.getLogger(__name__)

T = TypeVar("T")


class Responder:
    """The path every generating endpoint shares: the model check, the hand-over to the pipeline, the first
    output, and the answer, whole or streamed, with its counts and timings in the server's metrics."""

    def __init__(
        self,
        pipeline: AsyncPipeline,
        served_model_name: str,
        metrics: ServerMetrics,
        count: Callable[[str, int | str], None],
    ) -> None:
        """`count(path, status)` counts a request's outcome by its endpoint."""
        self.pipeline = pipeline
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.count = count

    def begin(self, request: Request, model: str) -> None:
        """A handler starts: its body is parsed and validated (the parse phase ends), and it must name the
        model this server serves."""
        state = request.state
        self.metrics.parsed(getattr(state, "arrived", None), getattr(state, "received", None))
        self.check_model(model)

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ModelNotFound(
                f"the model '{name}' does not exist; this server serves '{self.served_model_name}'"
            )

    def start(
        self, request: Request, new: GenerationRequest, stream: bool
    ) -> AsyncGenerator[RequestOutput, None]:
        """Hand the request over: its prepare phase ends, and so does its count among the requests being
        prepared (gate.py), as the pipeline takes it. Not `stream`ed, only its finished output comes back."""
        self.metrics.prepared(getattr(request.state, "received", None))
        request.state.response_id = new.request_id  # the response's x-request-id (gate.RequestIds)
        preparing: Preparing | None = getattr(request.state, "preparing", None)
        return self.pipeline.generate(new if stream else replace(new, final_only=True), preparing)

    async def respond(
        self, request: Request, endpoint: str, fmt: Format, new: GenerationRequest, stream: bool
    ) -> Response:
        """Run one request and answer it in `fmt`; with `new.speech` the reply is spoken too, and `fmt` is a
        SpeakingFormat."""
        outputs = self.start(request, new, stream)
        if stream:
            first = await self.first(request, outputs, fmt.id)
            delivered = first.metrics.get("delivered")
            return EventStream(
                self._events(endpoint, fmt, outputs, first), lambda: self.metrics.responded(delivered)
            )
        final = await self.final(request, outputs, fmt.id)
        text, reason, logprobs = (
            final.outputs[0].text,
            final.outputs[0].finish_reason,
            final.outputs[0].logprobs,
        )
        assert reason is not None  # a finished output has its finish_reason
        if isinstance(fmt, SpeakingFormat):
            assert (
                final.audio is not None
            )  # a finished spoken reply has its audio (empty when it said nothing)
            usage = usage_of(final, spoken=True)
            body = await asyncio.to_thread(fmt.spoken_response, text, reason, usage, final.audio)
        else:
            body = fmt.response(text, reason, usage_of(final, spoken=False), logprobs)
        self.count(endpoint, 200)
        return body if isinstance(body, Response) else JSONResponse(body)

    async def first(
        self, request: Request, outputs: AsyncGenerator[RequestOutput, None], request_id: str
    ) -> RequestOutput:
        """The request's first output, for a stream to start from (raising what kept the request out)."""
        return await pipeline_call(unless_disconnected(request, anext(outputs)), outputs, request_id)

    async def final(
        self, request: Request, outputs: AsyncGenerator[RequestOutput, None], request_id: str
    ) -> RequestOutput:
        """The request's finished output (raising if it failed), once the pipeline is done with it."""
        seen: list[RequestOutput] = []  # the latest only: a spoken reply's earlier ones hold its audio chunks

        async def collect() -> RequestOutput:
            async for output in outputs:
                seen[:] = [output]
            return seen[-1]

        try:
            final = await pipeline_call(unless_disconnected(request, collect()), outputs, request_id)
        finally:
            if seen:
                self.metrics.observe(seen[-1])
        raise_if_failed(final)
        return final

    def _events(
        self, endpoint: str, fmt: Format, outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput
    ) -> AsyncGenerator[str, None]:
        """The SSE body: opening chunk, deltas (text, and audio when spoken), the finishing chunk, usage if
        asked, then the format's end (`[DONE]`).

        The chunks of one output go out as one string: each yield is a send through every middleware and a
        socket write. `pending` holds those not yet yielded, so a failure sends them before its error.
        """
        last = first
        spoken = fmt if isinstance(fmt, SpeakingFormat) else None
        pending: list[str] = []

        async def sends() -> AsyncGenerator[str, None]:
            nonlocal last
            if fmt.continuous_usage:
                fmt.running_usage = usage_of(first, spoken=spoken is not None)
            pending.extend(fmt.opening())
            while True:
                completion = last.outputs[0]
                if fmt.continuous_usage:
                    fmt.running_usage = usage_of(last, spoken=spoken is not None)
                if last.finished:
                    break
                pending.extend(fmt.delta(completion.delta_text, None, completion.delta_logprobs))
                pending.extend(await _audio_chunks(spoken, last))
                if pending:
                    yield taken(pending)
                last = await anext(outputs)
            raise_if_failed(last)
            assert completion.finish_reason is not None  # a finished output has its finish_reason
            pending.extend(
                fmt.delta(completion.delta_text, completion.finish_reason, completion.delta_logprobs)
            )
            pending.extend(await _audio_chunks(spoken, last))
            if spoken is not None:
                pending.extend(await spoken.audio_end())
            pending.extend(fmt.closing(completion.finish_reason))
            if fmt.include_usage:
                pending.append(fmt.usage_chunk(usage_of(last, spoken=spoken is not None)))

        async def finished(status: int | str) -> None:
            if spoken is not None:
                spoken.release()
            await self.end(endpoint, outputs, last, status)

        return sse_body(sends(), pending, fmt, finished)

    async def end(
        self,
        endpoint: str,
        outputs: AsyncGenerator[RequestOutput, None],
        last: RequestOutput,
        status: int | str,
    ) -> None:
        """A streamed body is over, however it ended: the pipeline's stream closed (aborting the request if it
        still runs), its outcome counted and its last output observed."""
        await outputs.aclose()
        self.count(endpoint, status)
        self.metrics.observe(last)


async def sse_body(
    sends: AsyncGenerator[str, None],
    pending: list[str],
    fmt: Format,
    finished: Callable[[int | str], Awaitable[None]],
) -> AsyncGenerator[str, None]:
    """A streamed body: `sends`' strings, then what it left in `pending` and the format's end. After the 200
    went out a failure can only be told in the stream: what was pending, the error, the end. `finished` hears
    the status (200, the failure's, or "cancelled" where the client left) however the body ended."""
    status: int | str = "cancelled"
    try:
        async for body in sends:
            yield body
        yield "".join([*pending, fmt.done])
        status = 200
    except Exception as exc:
        failure, kind = failure_of(exc, fmt.id)
        status = kind.status
        yield "".join([*pending, sse(error_body(str(failure), kind)), fmt.done])
    finally:
        await sends.aclose()
        await finished(status)


def taken(pending: list[str]) -> str:
    """The pending chunks as one send (each is a pass through every middleware and a socket write), emptied."""
    body = "".join(pending)
    pending.clear()
    return body


def usage_of(output: RequestOutput, spoken: bool) -> Usage:
    """Prompt and generated tokens; a spoken reply's codec frames count as its audio tokens."""
    audio_tokens = output.num_audio_frames if spoken else None
    return Usage.of(len(output.prompt_token_ids), len(output.outputs[0].token_ids), audio_tokens)


async def _audio_chunks(fmt: SpeakingFormat | None, output: RequestOutput) -> list[str]:
    if fmt is None or output.audio_delta is None:
        return []
    return await fmt.audio(output.audio_delta)


def raise_if_failed(output: RequestOutput) -> None:
    reason = output.outputs[0].finish_reason
    if reason == "error":
        raise EngineFailure(f"the engine failed this request: {output.error or 'unknown error'}")
    if reason == "abort":
        raise EngineFailure("the engine aborted this request")


async def pipeline_call(call: Awaitable[T], outputs: AsyncGenerator[object, None], request_id: str) -> T:
    """Await a call on the request's stream; anything but our typed errors becomes an EngineFailure (500) for
    this request. On any failure the stream is closed, so nothing of the request stays behind."""
    try:
        return await call
    except BaseException as exc:
        await outputs.aclose()
        if isinstance(exc, OmnistageError) or not isinstance(exc, Exception):
            raise
        raise typed_failure(exc, request_id) from exc


def failure_of(exc: Exception, request_id: str) -> tuple[OmnistageError, ErrorKind]:
    """A failure after the 200 went out, typed, and its kind: it can only be told in the stream."""
    failure = typed_failure(exc, request_id)
    return failure, kind_of(failure)


def typed_failure(exc: Exception, request_id: str) -> OmnistageError:
    """Our typed errors as they are; anything else is this request's EngineFailure, logged with its trace."""
    if isinstance(exc, OmnistageError):
        return exc
    if isinstance(exc, StopAsyncIteration):
        return EngineFailure("the engine ended this request without a final output")
    log.error("request %s failed in the engine", request_id, exc_info=exc)
    return EngineFailure(f"the engine failed this request: {exc}")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # cancelling the stream's pending step aborts the request
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the channel's next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A streamed body (server-sent events, or raw audio) that stops as soon as its client leaves, and whose
    generator is always closed, so a client that leaves aborts its request.

    Under uvicorn (ASGI 2.3) Starlette streams in a task group beside a task listening for the disconnect,
    which cost a stream ~1 ms of the event loop before its first chunk (the respond phase at c=1 on the CPU
    machine). Here the response streams in its own task, and one task waits for the disconnect and cancels it.
    Closing the generator at the end runs its `finally`, which closes the pipeline's stream at once instead of
    whenever it is collected.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[Any, None],
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
                told, pending = pending, None
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
            # starlette types it as any async iterable; it is `chunks`, an async generator
            await cast("AsyncGenerator[Any, None]", self.body_iterator).aclose()
