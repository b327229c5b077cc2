"""uvicorn's HTTP protocol (httptools) with a deadline on each request's head.

uvicorn bounds only the idle time after a response (`timeout_keep_alive`), and any byte received cancels
that timer, so a client sending its headers a byte a second holds its connection, and a place under the
connection cap, for as long as it likes; one that sends nothing at all is never timed out. Here a request
line and headers that have not all arrived `header_timeout` seconds after the connection opened (or, for a
later request on it, after that request's first byte) get a 408 and the connection is closed.

httptools is a dependency, so this is the only protocol `serve` runs (h11 is never picked).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("omnistage.server")

_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose connections are closed when a request's head is not in within `header_timeout`
    seconds; `with_header_timeout` makes the subclass that uvicorn's Config takes as `http`."""

    header_timeout: float = 10.0

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # a later request on a kept-alive connection: the clock starts at its first byte

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:  # the first request's clock runs from the connection's opening
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's head is late while the one before it is still answering: that answer
            # (a long stream, say) is not cut; the late head gets another period once it is done.
            self._arm_head_timer()
            return
        logger.debug("closed %s: no whole request head within %s s", self.client, self.header_timeout)
        self.transport.write(_TIMED_OUT)
        self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's `Config(http=...)`, closing connections after `seconds` of no head."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})
