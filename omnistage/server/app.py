"""The OpenAI-compatible HTTP app around one AsyncPipeline: the app factory and its routes.

Each endpoint family has its module (chat.py, completions.py, speech.py, transcriptions.py: translations too); they share the path
from a request to its answer (streaming.py) and read of the pipeline only its Frontend, taken once here.
Rendering, tokenizing and media fetching and decoding (`omnistage.media`) run in worker threads with calls
that let go of the GIL, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from omnistage.media import MediaPolicy
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.preparing import prepare_on_threads
from omnistage.server import chat, completions, responses_api, speech, transcriptions
from omnistage.server.errors import install_error_handlers
from omnistage.server.gate import DEFAULT_MAX_BODY_BYTES, CatchAll, Gate, RequestIds
from omnistage.server.json_route import JSONRoute
from omnistage.server.metrics import ServerMetrics
from omnistage.server.playground import add_playground
from omnistage.server.realtime.link import Services
from omnistage.server.realtime.route import PATH as REALTIME_PATH
from omnistage.server.realtime.route import RealtimeEndpoint, RealtimeLimits
from omnistage.server.reasoning import AUTO, chosen_parser
from omnistage.server.responses import ModelCard, ModelList
from omnistage.server.spoken_answers import DEFAULT_MAX_ANSWERS, DEFAULT_RETENTION_S, SpokenAnswers
from omnistage.server.streaming import Responder
from omnistage.server.voices import Voices

GENERATING = frozenset(
    {
        chat.PATH,
        responses_api.PATH,
        completions.PATH,
        transcriptions.PATH,
        transcriptions.TRANSLATIONS_PATH,
        speech.PATH,
    }
)
VOICES_PATH = "/v1/audio/voices"
_ENDPOINTS = GENERATING | {"/v1/models", VOICES_PATH, "/health", "/metrics"}


def build_app(
    pipeline: AsyncPipeline,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    media: MediaPolicy | None = None,
    voice_aliases: Mapping[str, str] | None = None,
    answers: SpokenAnswers | None = None,
    responses: responses_api.ResponseStore | None = None,
    playground: bool = True,
    reasoning_parser: str = AUTO,
    realtime: RealtimeLimits | None = None,
) -> FastAPI:
    """The FastAPI app serving `pipeline` under `served_model_name`; /v1/* needs `api_key` when one is given.

    `media` says where attachments may come from (default: inline data only); `voice_aliases` names speakers
    beyond the default table (voices.py: raises ConfigError for a speaker the checkpoint lacks); `answers`
    keeps spoken answers for later turns (default: an hour, 10,000 of them), `responses` the Responses API's
    responses for `previous_response_id` (default: an hour, 1,000 of them); `playground` serves the page at /
    and /playground (playground.py); `reasoning_parser` splits a chat reply's think block into
    `reasoning_content` (reasoning.py: `auto` chooses by the checkpoint); `realtime` bounds the realtime
    sessions of /v1/realtime (their number, idle time and conversation length).
    """
    media = media or MediaPolicy()
    frontend = pipeline.frontend
    voices = Voices.of(frontend.voices, voice_aliases)
    answers = answers if answers is not None else SpokenAnswers(DEFAULT_RETENTION_S, DEFAULT_MAX_ANSWERS)
    if responses is None:
        responses = responses_api.ResponseStore(
            responses_api.DEFAULT_RETENTION_S, responses_api.DEFAULT_MAX_RESPONSES
        )
    fingerprint = system_fingerprint(served_model_name, frontend.model_path)
    parser = chosen_parser(reasoning_parser, frontend.model_path)
    serving = chat.ChatServing(voices, answers, fingerprint, parser)
    metrics = ServerMetrics()
    metrics.set_plan(frontend)

    def count(path: str, status: int | str) -> None:
        endpoint = path if path in _ENDPOINTS else "other"
        metrics.count(endpoint, "cancelled" if status == 499 else status)

    responder = Responder(pipeline, served_model_name, metrics, count)
    info = _Info(pipeline, responder, voices)
    app = FastAPI(title="omnistage", version=_version(), lifespan=_preparing_threads)
    install_error_handlers(app, lambda request, status: count(request.url.path, status))
    app.add_middleware(
        Gate,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_reject=count,
        preparing=pipeline.preparing,
        preparing_paths=GENERATING,
    )
    app.add_middleware(CatchAll, count=count)
    app.add_middleware(RequestIds)  # added last: the outermost, so that every response carries its id

    v1 = APIRouter(prefix="/v1")
    chat_endpoint = chat.ChatEndpoint(responder, frontend, media, serving)
    responses_endpoint = responses_api.ResponsesEndpoint(responder, chat_endpoint, responses)
    json_routes = (
        (chat.PATH, chat_endpoint.create),
        (responses_api.PATH, responses_endpoint.create),
        (completions.PATH, completions.CompletionsEndpoint(responder, frontend).create),
        (speech.PATH, speech.SpeechEndpoint(responder, frontend, voices).create),
    )
    for path, endpoint in json_routes:
        v1.add_api_route(
            path.removeprefix("/v1"),
            endpoint,
            methods=["POST"],
            response_model=None,
            route_class_override=JSONRoute,
        )
    audio_in = transcriptions.TranscriptionsEndpoint(responder, frontend, media)
    for path, form_endpoint in (
        (transcriptions.PATH, audio_in.create),
        (transcriptions.TRANSLATIONS_PATH, audio_in.translate),
    ):
        v1.add_api_route(path.removeprefix("/v1"), form_endpoint, methods=["POST"], response_model=None)
    by_id = responses_api.PATH.removeprefix("/v1") + "/{response_id}"
    v1.add_api_route(by_id, responses_endpoint.retrieve, methods=["GET"])
    v1.add_api_route(by_id, responses_endpoint.delete, methods=["DELETE"])
    v1.add_api_route("/models", info.models, methods=["GET"])
    v1.add_api_route(VOICES_PATH.removeprefix("/v1"), info.voices, methods=["GET"])
    v1.add_api_route("/models/{model:path}", info.model, methods=["GET"])
    app.include_router(v1)
    realtime = realtime or RealtimeLimits()
    context = frontend.max_model_len
    most = min(realtime.max_conversation_tokens or context, context)
    sessions = Services(pipeline, voices, metrics, most)
    app.add_api_websocket_route(
        REALTIME_PATH, RealtimeEndpoint(sessions, served_model_name, api_key, realtime)
    )
    app.add_api_route("/health", info.health, methods=["GET"])
    app.add_api_route("/metrics", info.metrics_text, methods=["GET"])
    if playground:
        add_playground(app)
    return app


@asynccontextmanager
async def _preparing_threads(app: FastAPI) -> AsyncIterator[None]:
    """The server's event loop prepares requests on threads enough for many at once (pipeline/preparing.py)."""
    prepare_on_threads(asyncio.get_running_loop())
    yield


def system_fingerprint(served_model_name: str, model_path: object) -> str:
    """A stable mark of what answers: the model (its name and checkpoint) and omnistage's version."""
    digest = hashlib.sha256(f"{served_model_name}\0{model_path}\0{_version()}".encode()).hexdigest()
    return f"fp_{digest[:12]}"


def _version() -> str:
    try:
        return version("omnistage")
    except PackageNotFoundError:
        return "0+unknown"


class _Info:
    """The routes that generate nothing: the model cards, the voices, health and the metrics."""

    def __init__(self, pipeline: AsyncPipeline, responder: Responder, voices: Voices) -> None:
        self.pipeline, self.responder, self._voices = pipeline, responder, voices
        self.created = int(time.time())

    async def voices(self) -> JSONResponse:
        """The checkpoint's speakers and the other names of them (OpenAI's among them)."""
        return JSONResponse(self._voices.listing())

    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    async def model(self, model: str) -> ModelCard:
        self.responder.check_model(model)
        return self._card()

    async def health(self) -> JSONResponse:
        if self.pipeline.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_text(self) -> Response:
        text = self.responder.metrics.render(self.pipeline.stats())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _card(self) -> ModelCard:
        frontend = self.pipeline.frontend
        return ModelCard(
            id=self.responder.served_model_name,
            created=self.created,
            root=str(frontend.model_path),
            max_model_len=frontend.max_model_len,
        )
