"""The OpenAI-compatible HTTP app around one AsyncPipeline: the app factory and its routes.

Each endpoint family has its module (chat.py, completions.py, speech.py, transcriptions.py); they share the path
from a request to its answer (streaming.py) and read of the pipeline only its Frontend, taken once here.
Rendering, tokenizing and media fetching and decoding (`omnistage.media`) run in worker threads with calls
that let go of the GIL, never on the event loop.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from omnistage.media import MediaPolicy
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import chat, completions, speech, transcriptions
from omnistage.server.errors import install_error_handlers
from omnistage.server.gate import DEFAULT_MAX_BODY_BYTES, CatchAll, Gate
from omnistage.server.json_route import JSONRoute
from omnistage.server.metrics import ServerMetrics
from omnistage.server.responses import ModelCard, ModelList
from omnistage.server.streaming import Responder

GENERATING = frozenset({chat.PATH, completions.PATH, transcriptions.PATH, speech.PATH})
_ENDPOINTS = GENERATING | {"/v1/models", "/health", "/metrics"}


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
    media = media or MediaPolicy()
    frontend = pipeline.frontend
    metrics = ServerMetrics()
    metrics.set_plan(frontend)

    def count(path: str, status: int | str) -> None:
        endpoint = path if path in _ENDPOINTS else "other"
        metrics.count(endpoint, "cancelled" if status == 499 else status)

    responder = Responder(pipeline, served_model_name, metrics, count)
    info = _Info(pipeline, responder)
    app = FastAPI(title="omnistage", version=_version())
    install_error_handlers(app, lambda request, status: count(request.url.path, status))
    app.add_middleware(
        Gate,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_reject=count,
        preparing=pipeline.preparing,
        preparing_paths=GENERATING,
    )
    app.add_middleware(CatchAll, count=count)  # added last: the outermost

    v1 = APIRouter(prefix="/v1")
    json_routes = (
        (chat.PATH, chat.ChatEndpoint(responder, frontend, media).create),
        (completions.PATH, completions.CompletionsEndpoint(responder, frontend).create),
        (speech.PATH, speech.SpeechEndpoint(responder, frontend).create),
    )
    for path, endpoint in json_routes:
        v1.add_api_route(
            path.removeprefix("/v1"),
            endpoint,
            methods=["POST"],
            response_model=None,
            route_class_override=JSONRoute,
        )
    transcribe = transcriptions.TranscriptionsEndpoint(responder, frontend, media).create
    v1.add_api_route(
        transcriptions.PATH.removeprefix("/v1"), transcribe, methods=["POST"], response_model=None
    )
    v1.add_api_route("/models", info.models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", info.model, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", info.health, methods=["GET"])
    app.add_api_route("/metrics", info.metrics_text, methods=["GET"])
    return app


def _version() -> str:
    try:
        return version("omnistage")
    except PackageNotFoundError:
        return "0+unknown"


class _Info:
    """The routes that generate nothing: the model cards, health and the metrics."""

    def __init__(self, pipeline: AsyncPipeline, responder: Responder) -> None:
        self.pipeline, self.responder = pipeline, responder
        self.created = int(time.time())

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
