"""A thin HTTP/1.1 client for streamed benchmark requests: h11 over asyncio streams, a keep-alive connection
per request in flight.

A server benchmark should time the server, not its client. Against the same server on the H200's host, httpx
(httpcore and anyio beneath it) added 2.3 ms to a lone request's first token and 40 ms to a 16-request burst's:
writing a clip's ~300 KB body took it 1.96 ms against 0.26 here, and 23.75 against 2.01 ms in the burst, from
its one event loop (benchmarks/RESULTS.md, "The client's share"). Here a request is its bytes,
framed by h11, written at once; the response's chunks are read as they come and split into server-sent
events. `omnistage bench a2t --http-client httpx` keeps the httpx client, to measure the difference.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import h11

_READ = 1 << 16


class StreamClient:
    """POSTs whose responses are streams of server-sent events, to one server (`url`: http://host:port)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        """`timeout`: the longest wait, in seconds, for a connection, a write or a read, as httpx's timeouts."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the benchmark's client speaks plain http://host:port, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = [("host", parts.netloc), *(headers or {}).items()]
        self.timeout = timeout
        self._idle: list[_Connection] = []

    async def events(
        self, path: str, body: bytes, headers: dict[str, str], stamps: dict[str, float]
    ) -> AsyncIterator[dict[str, Any]]:
        """The JSON payloads of the POST's events up to `[DONE]`, each as soon as its bytes are in.

        `stamps` gets the times (perf_counter) at which the request was written ("sent"), its response's
        headers were read ("headers") and `[DONE]` arrived ("done"). A status other than 200, or an error event,
        raises RuntimeError with the server's message.
        """
        if self._idle:
            connection = self._idle.pop()
        else:
            connection = await _Connection.open(self.host, self.port, self.timeout)
        reusable = False
        try:
            status, chunks = await connection.post(path, [*self.headers, *headers.items()], body, stamps)
            if status != 200:
                text = b"".join([chunk async for chunk in chunks]).decode(errors="replace")
                reusable = connection.next_cycle()
                raise RuntimeError(f"{path}: HTTP {status}: {error_message(text)}")
            async for event in sse_events(path, chunks, stamps):
                yield event
            async for _ in chunks:  # the end of the body, so that the connection serves the next request
                pass
            reusable = connection.next_cycle()
        finally:
            if reusable:
                self._idle.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> _Connection:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, timeout)

    async def post(
        self, path: str, headers: list[tuple[str, str]], body: bytes, stamps: dict[str, float]
    ) -> tuple[int, AsyncIterator[bytes]]:
        """Write the request; return the response's status once its headers are in, and its body's chunks."""
        request = h11.Request(
            method="POST", target=path, headers=[*headers, ("content-length", str(len(body)))]
        )
        self.writer.write(self.h11.send(request) or b"")
        self.writer.write(self.h11.send(h11.Data(data=body)) or b"")
        self.writer.write(self.h11.send(h11.EndOfMessage()) or b"")
        async with asyncio.timeout(self.timeout):
            await self.writer.drain()
        stamps["sent"] = time.perf_counter()
        event = await self._next()
        if not isinstance(event, h11.Response):
            raise RuntimeError(f"{path}: the server answered {event!r}")
        stamps["headers"] = time.perf_counter()
        return event.status_code, self._body()

    async def _body(self) -> AsyncIterator[bytes]:
        while True:
            event = await self._next()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def _next(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                if isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the server closed the connection mid-response")
                return event
            async with asyncio.timeout(self.timeout):
                data = await self.reader.read(_READ)
            self.h11.receive_data(data)

    def next_cycle(self) -> bool:
        """Ready the connection for another request; False when the server is closing it."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.writer.close()


async def sse_events(
    path: str, chunks: AsyncIterator[bytes], stamps: dict[str, float]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of the `data:` lines in a response's `chunks` up to `[DONE]` (its time goes into
    `stamps["done"]`); blank lines and other fields are skipped, an error event raises RuntimeError."""
    pending = b""
    async for chunk in chunks:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                stamps["done"] = time.perf_counter()
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{path}: error in the stream: {event['error'].get('message')}")
            yield event


def error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body as it is."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text
