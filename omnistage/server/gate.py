"""The app's outer layers, as plain ASGI: the catch-all outermost, then the door: the API key on /v1/*, and the
body size limit on everything.

The door's checks run before FastAPI reads or parses a byte, so a wrong key is a 401 whatever the body, and an
oversized body is refused (413) without being held in memory. A body let through is stamped with the time
it was complete (`received` in the request's state, beside `arrived`, when its headers were), where the
server's timing of a request starts, and a request to a generating path (`preparing_paths`) is counted as
being prepared from then (`preparing`, the engine's count: an idle engine waits for a burst's last request)
until its handler hands it over or it ends.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.errors import OmnistageError
from omnistage.pipeline.async_pipeline import Preparing
from omnistage.server.errors import BodyTooLarge, Unauthorized, error_response, internal_error_response

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


class HttpLayer:
    """A layer of plain ASGI around `app` for its HTTP requests (anything else passes straight through);
    `count(path, status)` counts the requests the layer answers itself."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class CatchAll(HttpLayer):
    """The outermost layer of the app: an exception that escapes everything else becomes a JSON 500 that
    names no internals, and its traceback goes to the log.

    Answering here (rather than letting the server's last-resort handler answer) keeps a keep-alive
    connection usable. A response that had already started cannot be replaced: the exception goes on to
    the server, which closes the connection, the only way left to tell the client.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            self.count(scope["path"], 500)
            await internal_error_response()(scope, receive, send)


class Gate(HttpLayer):
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        on_reject: Callable[[str, int], None],
        preparing: Callable[[], Preparing] | None = None,
        preparing_paths: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(app, on_reject)
        self.preparing, self.preparing_paths = preparing, preparing_paths
        # Compared as bytes: a header is bytes on the wire, and compare_digest refuses non-ASCII str.
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
            await self._reject(scope, receive, send, Unauthorized("missing or invalid API key"))
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._reject(scope, receive, send, self._too_large(int(length)))
            return
        arrived = time.monotonic()  # the request line and headers are in
        body, over = await self._read_body(receive)
        if over:
            await self._reject(scope, receive, send, self._too_large(None))
            return
        # the whole body is in: a request's "prepare" phase (server/metrics.py) starts here
        state = scope.setdefault("state", {})
        state["arrived"], state["received"] = arrived, time.monotonic()
        if self.preparing is None or scope["path"] not in self.preparing_paths:
            await self.app(scope, _replay(body, receive), send)
            return
        state["preparing"] = ticket = self.preparing()
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            ticket.done()

    def _authorized(self, scope: Scope) -> bool:
        header = _raw_header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key or b"")

    def _too_large(self, length: int | None) -> BodyTooLarge:
        size = f"{length:,} bytes" if length is not None else "more"
        return BodyTooLarge(f"the request body is {size}; the limit is {self.max_body_bytes:,} bytes")

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", False  # the client left; the app will see the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _reject(self, scope: Scope, receive: Receive, send: Send, exc: OmnistageError) -> None:
        response = error_response(exc)
        self.count(scope["path"], response.status_code)
        await response(scope, receive, send)


def _raw_header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    value = _raw_header(scope, name)
    return None if value is None else value.decode("latin-1")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the already-read body once, then the real channel (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# A client's own id longer than this is not echoed (nor one holding anything but visible ASCII).
MAX_REQUEST_ID = 200


class RequestIds(HttpLayer):
    """Every response carries `x-request-id`: the client's own where it sent one, else the id of the response
    (`response_id` in the request's state, set as a generating request is handed over), else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, lambda path, status: None)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = _raw_header(scope, b"x-request-id")
        if given is not None and not _visible(given):
            given = None

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_id = scope.get("state", {}).get("response_id")
                value = given or (response_id or f"req-{secrets.token_hex(16)}").encode("ascii")
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, stamped)


def _visible(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and all(0x21 <= byte <= 0x7E for byte in value)
