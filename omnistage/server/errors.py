"""The one place where errors become HTTP responses in OpenAI's shape.

Every error body is `{"error": {"message", "type", "param", "code"}}`, as the official client expects.
Typed errors raised anywhere (engine, protocol, middleware) are mapped here by class, most specific first;
anything else that escapes the app (gate.py's `CatchAll`) is a 500 that names no internals, logged with its
traceback.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.errors import InvalidMedia, InvalidRequest, OmnistageError, QueueFull, RequestTooLarge


class Unauthorized(OmnistageError):
    """The API key is missing or wrong (HTTP 401)."""


class ModelNotFound(OmnistageError):
    """The request names a model this server does not serve (HTTP 404)."""


class BodyTooLarge(OmnistageError):
    """The request body is over the server's size limit (HTTP 413)."""


class NotFound(OmnistageError):
    """The request names a stored object (a response, by id) that is not kept (HTTP 404)."""


class EngineFailure(OmnistageError):
    """The engine failed this one request (HTTP 500); the server goes on serving."""


class ClientGone(OmnistageError):
    """The client disconnected before its response was ready; nobody reads what is sent back."""


class InvalidField(InvalidRequest):
    """One field of the body is invalid (HTTP 400 whose `param` names the field)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}" if param else reason)
        self.param, self.reason = param or None, reason


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str | None = None


# Most specific first: RequestTooLarge and InvalidMedia before their base InvalidRequest.
_KINDS: list[tuple[type[Exception], ErrorKind]] = [
    (RequestTooLarge, ErrorKind(400, "invalid_request_error", "request_too_large")),
    (InvalidMedia, ErrorKind(400, "invalid_request_error", "invalid_media")),
    (InvalidRequest, ErrorKind(400, "invalid_request_error")),
    (Unauthorized, ErrorKind(401, "authentication_error", "invalid_api_key")),
    (ModelNotFound, ErrorKind(404, "invalid_request_error", "model_not_found")),
    (NotFound, ErrorKind(404, "invalid_request_error", "not_found")),
    (BodyTooLarge, ErrorKind(413, "invalid_request_error", "body_too_large")),
    (QueueFull, ErrorKind(503, "server_overloaded", "queue_full")),
    (EngineFailure, ErrorKind(500, "server_error", "engine_error")),
    (ClientGone, ErrorKind(499, "client_closed_request")),
]
_INTERNAL = ErrorKind(500, "server_error", "internal_error")
# A full queue moves at the engine's pace; a client told to come back in a second (OpenAI's client honours
# Retry-After) does not hammer it meanwhile.
RETRY_AFTER_S = 1
# The pipeline marks an error with the part of the request it is about (`field`); each route names the
# client's field for it.
_FIELDS = {
    "/v1/audio/speech": {"voice": "voice", "max_frames": "max_frames", "text": "input"},
    "/v1/chat/completions": {
        "voice": "audio.voice",
        "max_frames": "audio.max_frames",
        "text": "max_tokens",
        "logit_bias": "logit_bias",
    },
    "/v1/completions": {"logit_bias": "logit_bias"},
}


def kind_of(exc: Exception) -> ErrorKind:
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind
    return _INTERNAL


def error_body(message: str, kind: ErrorKind, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind.type, "param": param, "code": kind.code}}


def error_response(exc: OmnistageError, path: str = "") -> JSONResponse:
    """The HTTP response for one of our errors (one without a kind of its own is a 500 keeping its message);
    `path`, the request's, names the field of the pipeline's error (`field`)."""
    kind = kind_of(exc)
    message = str(exc) or type(exc).__name__
    param = getattr(exc, "param", None) or _FIELDS.get(path, {}).get(getattr(exc, "field", None) or "")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, QueueFull) else None
    return JSONResponse(error_body(message, kind, param), status_code=kind.status, headers=headers)


def internal_error_response() -> JSONResponse:
    return JSONResponse(
        error_body("the server failed this request (an internal error, logged)", _INTERNAL), status_code=500
    )


_UNION_TAGS = {"str", "int", "float", "bool"}


def field_path(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "content", "list[ContentPart]", 0, "type") -> "messages[0].content[0].type".

    pydantic puts the union member it tried into the path ("str", "list[int]"); the client never wrote
    those, so they are left out.
    """
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part:
            path += f".{part}" if path else part
    return path


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming each bad field's path, and the first path as OpenAI's `param`."""
    found: dict[tuple[str, str], None] = {}  # (path, reason), in order and once each
    for err in exc.errors():
        if err["type"] == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            found[
                ("", f"the body is not valid JSON ({reason})" if reason else "the body is not valid JSON")
            ] = None
            continue
        path = field_path(tuple(err["loc"]))
        if not path and err["type"] == "missing":
            found[("", "the request body is missing")] = None
            continue
        reason = (
            "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        )
        given = err.get("input")
        if err["type"] not in ("missing", "extra_forbidden", "value_error") and isinstance(
            given, str | int | float | bool
        ):
            reason += f" (got {reprlib.repr(given)})"  # abbreviated: a 400-digit number is not echoed whole
        found[(path, reason)] = None
    # Of a union, the member the client evidently meant failed deeper: drop the shallower complaints.
    # (Linear in the paths' length: a body of ten thousand bad fields is answered at once.)
    shallower = {q[:i] for q, _ in found for i, c in enumerate(q) if c in ".["}
    kept = [(p, r) for p, r in found if not p or p not in shallower]
    parts = [f"{p}: {r}" if p else r for p, r in kept[:3]]
    if len(kept) > 3:
        parts.append(f"and {len(kept) - 3} more")
    param = next((p for p, _ in kept if p), None)
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None]) -> None:
    """Map every error the app can raise to the OpenAI shape; `on_error` sees (request, status) for metrics."""

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        kind = ErrorKind(400, "invalid_request_error")
        on_error(request, kind.status)
        return JSONResponse(error_body(message, kind, param), status_code=kind.status)

    @app.exception_handler(OmnistageError)
    async def _ours(request: Request, exc: OmnistageError) -> JSONResponse:
        response = error_response(exc, request.url.path)
        on_error(request, response.status_code)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorKind(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error"
        )
        on_error(request, exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers
        )
