"""The benches' side of a running server: its API key as a header, the model it serves, a pool of httpx
connections, and a POST's server-sent events through either client (sse_client.py's, or httpx's)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnistage.bench.sse_client import StreamClient, error_message, sse_events

if TYPE_CHECKING:
    import httpx


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(url: str, api_key: str | None) -> str:
    import httpx

    response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=auth(api_key), timeout=10)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/models: HTTP {response.status_code}: {error_message(response.text)}")
    return response.json()["data"][0]["id"]


def http_pool(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    """An httpx client based at `url` with a connection per request in flight: a smaller pool would queue
    requests here and count it as latency."""
    import httpx

    return httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=auth(api_key),
        timeout=httpx.Timeout(600.0, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def events(
    client: StreamClient | httpx.AsyncClient,
    path: str,
    body: bytes,
    headers: dict[str, str],
    stamps: dict[str, float],
) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a POST's server-sent events up to `[DONE]`, each as soon as it arrives; `stamps` as
    StreamClient.events fills it (httpx's from httpcore's trace events).

    A refused request (HTTP status other than 200) or an error event in the stream raises RuntimeError with
    the server's message.
    """
    if isinstance(client, StreamClient):
        async for event in client.events(path, body, headers, stamps):
            yield event
        return

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event in _HTTPCORE_STAMPS:
            stamps[_HTTPCORE_STAMPS[event]] = time.perf_counter()

    request: dict[str, Any] = {"content": body, "headers": headers, "extensions": {"trace": trace}}
    async with client.stream("POST", path, **request) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {error_message(response.text)}")
        async for event in sse_events(path, response.aiter_bytes(), stamps):
            yield event


@dataclass(frozen=True)
class SpokenStream:
    """A streamed spoken chat reply as the client saw it: when it was sent, when its first audio arrived
    (None: it had none), how many PCM bytes came, and the usage its last chunk carried."""

    start: float
    first_audio: float | None
    pcm_bytes: int
    usage: dict[str, Any]


async def spoken_chat(client: StreamClient | httpx.AsyncClient, payload: bytes) -> SpokenStream:
    """A streamed /v1/chat/completions request whose reply speaks (pcm16), timed from its sending."""
    start = time.perf_counter()
    first, pcm_bytes = None, 0
    usage: dict[str, Any] = {}
    async for event in events(client, "/v1/chat/completions", payload, JSON_HEADERS, {}):
        for choice in event.get("choices") or []:
            data = ((choice.get("delta") or {}).get("audio") or {}).get("data")
            if data:
                first = first or time.perf_counter()
                pcm_bytes += (
                    len(data) * 3 // 4 - data.endswith("=") - data.endswith("==")
                )  # base64's length, not decoded
        usage = event.get("usage") or usage
    return SpokenStream(start, first, pcm_bytes, usage)


JSON_HEADERS = {"content-type": "application/json"}
_HTTPCORE_STAMPS = {
    "http11.send_request_body.complete": "sent",
    "http11.receive_response_headers.complete": "headers",
}
