"""Slow clients against a live server: heads trickling a byte at a time are cut off at --header-timeout
while other requests are served, and --max-connections caps the connections served."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

HEADER_TIMEOUT = 1.0
SLACK = 2.0  # a loaded two-core machine: the server's timer and our reads may each be late
MAX_CONNECTIONS = 32
SLOW_CLIENTS = 24  # beside them, the normal requests stay under the cap
TRICKLE_S = 0.2
# Long enough that trickling it whole would take 20 s: a server that waits for it fails the test.
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"


@pytest.fixture(scope="module")
def server(launch_server):
    with launch_server(
        "slow-clients", "--header-timeout", str(HEADER_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS)
    ) as live:
        yield live


async def trickle(port: int, head: bytes) -> tuple[float, bytes]:
    """Send `head` a byte every TRICKLE_S until the server closes the connection (or for at most the timeout
    and its slack and a second more); the seconds the connection stayed open, and what the server sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    deadline = start + HEADER_TIMEOUT + SLACK + 1
    answer = asyncio.create_task(reader.read())  # to the server's end of the stream
    try:
        for byte in head:
            if time.monotonic() > deadline:
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                break
            done, _ = await asyncio.wait([answer], timeout=TRICKLE_S)
            if done:
                break
        try:
            got = await asyncio.wait_for(answer, max(0.5, deadline - time.monotonic()))
        except TimeoutError:
            got = b"(still open)"
        except ConnectionError as exc:
            got = repr(exc).encode()
        return time.monotonic() - start, got
    finally:
        answer.cancel()
        writer.close()


def test_heads_trickling_in_are_cut_off_while_others_are_served(server):
    async def run() -> tuple[list[tuple[float, bytes]], list[tuple[float, int]]]:
        slow = [asyncio.create_task(trickle(server.port, SLOW_HEAD)) for _ in range(SLOW_CLIENTS)]
        silent = asyncio.create_task(trickle(server.port, b""))  # connects and sends nothing
        served = []
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            for _ in range(3):  # while the slow heads trickle, before and after the server cuts them off
                await asyncio.sleep(0.6)
                start = time.monotonic()
                response = await client.get("/v1/models")
                served.append((time.monotonic() - start, response.status_code))
        return await asyncio.gather(*slow, silent), served

    closed, served = asyncio.run(run())
    assert [status for _, status in served] == [200, 200, 200]
    assert all(seconds < 1.0 for seconds, _ in served), served
    for seconds, answer in closed:
        assert seconds <= HEADER_TIMEOUT + SLACK, f"open for {seconds:.1f} s: {answer[:40]!r}"
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:40]
    assert min(seconds for seconds, _ in closed) >= HEADER_TIMEOUT - 0.1


def request(sock: socket.socket, path: str = "/health") -> bytes:
    """One keep-alive GET on `sock`: the status line of its answer (whose body is read too)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status, *fields = head.split(b"\r\n")
    length = int(dict(f.lower().split(b": ", 1) for f in fields)[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return status


def test_connections_past_the_cap_get_503(server):
    # Kept-alive connections that each had an answer are certainly open on the server's side.
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        assert {request(sock) for sock in held} == {b"HTTP/1.1 200 OK"}
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert request(extra) == b"HTTP/1.1 503 Service Unavailable"
            assert extra.recv(1) == b""  # and the server closed it
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:  # once the server has seen one of them go, there is a place again
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
                status = request(extra)
            if status == b"HTTP/1.1 200 OK" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == b"HTTP/1.1 200 OK"
    finally:
        for sock in held:
            sock.close()


def test_a_kept_alive_connection_trickling_its_next_head_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        assert request(sock) == b"HTTP/1.1 200 OK"
        time.sleep(HEADER_TIMEOUT + 0.2)  # idle between requests: uvicorn's keep-alive (5 s), not the head's
        sock.settimeout(TRICKLE_S)
        start, answer = time.monotonic(), b""
        for byte in SLOW_HEAD:
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(256)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            break  # the server answered (or closed)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 ") and HEADER_TIMEOUT - 0.1 <= seconds <= HEADER_TIMEOUT + SLACK
