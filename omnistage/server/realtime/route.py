"""`/v1/realtime`: the WebSocket door of realtime sessions (OpenAI's Realtime API).

The handshake is checked before the socket is accepted, each refusal an HTTP answer in OpenAI's error shape:
the API key as the HTTP API's (a bearer token, or, from a browser, which cannot set headers on a WebSocket, the
subprotocol `openai-insecure-api-key.<key>` as OpenAI takes it; 401), the model (`?model=`, 404; a transcription session,
`?intent=transcription`, names its transcriber instead and is not checked), and the number of sessions open
(`max_sessions`; 429). An accepted session is read frame by frame until its client closes, goes away, or
stays idle (no event, nothing running) for `idle_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnistage.server.errors import ErrorKind, error_body
from omnistage.server.realtime.link import Services
from omnistage.server.realtime.session import Session
from omnistage.server.realtime.settings import Settings

log = logging.getLogger(__name__)

PATH = "/v1/realtime"
DEFAULT_IDLE_TIMEOUT_S = 600.0
# A close code of the WebSocket protocol's private range, saying why the server closed the session.
IDLE_CLOSE = 4000
# A browser's key rides in a subprotocol of this prefix; the session then speaks the subprotocol `realtime`,
# which a browser that offered subprotocols needs the server to pick (it fails the handshake otherwise).
KEY_PROTOCOL = "openai-insecure-api-key."
SUBPROTOCOL = "realtime"


@dataclass(frozen=True)
class RealtimeLimits:
    """`max_sessions` open at once (None: no limit), the seconds a session may sit idle, and the most tokens
    its conversation may render to (None: the model's context)."""

    max_sessions: int | None = None
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_conversation_tokens: int | None = None


class RealtimeEndpoint:
    def __init__(
        self, services: Services, served_model_name: str, api_key: str | None, limits: RealtimeLimits
    ) -> None:
        self.services, self.served_model_name, self.limits = services, served_model_name, limits
        self.api_key = None if api_key is None else api_key.encode()
        self.open = 0

    async def __call__(self, websocket: WebSocket) -> None:
        refusal = self._refusal(websocket)
        if refusal is not None:
            status, kind, message, param = refusal
            body = error_body(message, ErrorKind(status, kind[0], kind[1]), param)
            await websocket.send_denial_response(JSONResponse(body, status_code=status))
            return
        self.open += 1
        self.services.metrics.realtime_sessions.inc()
        try:
            await self._serve(websocket)
        finally:
            self.open -= 1
            self.services.metrics.realtime_sessions.dec()

    def _refusal(self, websocket: WebSocket) -> tuple[int, tuple[str, str], str, str | None] | None:
        if self.api_key is not None and not self._authorized(websocket):
            return 401, ("authentication_error", "invalid_api_key"), "missing or invalid API key", None
        query = websocket.query_params
        model = query.get("model")
        if query.get("intent") not in (None, "transcription"):
            message = (
                f"intent {query.get('intent')!r} is not supported; leave it out, or ask for transcription"
            )
            return 400, ("invalid_request_error", "invalid_value"), message, "intent"
        if query.get("intent") is None and model is not None and model != self.served_model_name:
            message = f"the model '{model}' does not exist; this server serves '{self.served_model_name}'"
            return 404, ("invalid_request_error", "model_not_found"), message, "model"
        limit = self.limits.max_sessions
        if limit is not None and self.open >= limit:
            message = f"the server holds {self.open} realtime sessions, its limit (--max-sessions {limit})"
            return 429, ("rate_limit_exceeded", "session_limit_reached"), message, None
        return None

    def _authorized(self, websocket: WebSocket) -> bool:
        header = (websocket.headers.get("authorization") or "").encode("latin-1")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key or b""):
            return True
        offered = [
            p[len(KEY_PROTOCOL) :]
            for p in websocket.scope.get("subprotocols", ())
            if p.startswith(KEY_PROTOCOL)
        ]
        return any(
            secrets.compare_digest(key.encode("latin-1", "replace"), self.api_key or b"") for key in offered
        )

    def _settings(self, websocket: WebSocket) -> Settings:
        speaks = bool(self.services.voices.speakers)
        if websocket.query_params.get("intent") == "transcription":
            model = websocket.query_params.get("model") or self.served_model_name
            return Settings("transcription", model, modalities=("text",))
        return Settings("realtime", self.served_model_name, modalities=("audio",) if speaks else ("text",))

    async def _serve(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols", ())
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        session = Session(websocket, self._settings(websocket), self.services)
        try:
            await session.opened()
            while not session.closed:
                try:
                    message = await asyncio.wait_for(websocket.receive(), self.limits.idle_timeout_s)
                except TimeoutError:
                    if session.busy:
                        continue
                    await session.error(
                        f"the session was idle for {self.limits.idle_timeout_s:g} s; it is closed",
                        "session_expired",
                    )
                    await websocket.close(IDLE_CLOSE, "idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                frame = message.get("text")
                await session.handle(frame if frame is not None else message.get("bytes") or b"")
        except WebSocketDisconnect:
            return
        finally:
            await session.close()
