"""One replica of the server on Ray Serve: the pipeline its config describes, loaded on the GPUs Ray gives it,
and the single server's app in front of it, answering every route the single server does (Serve's proxy hands
it each HTTP request and WebSocket as ASGI). Two things are added on the way out: an `x-omnistage-replica`
header naming the replica that answered, and `/metrics` of every replica at once (metrics.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import MutableMapping
from typing import Any

import httpx
import ray
from ray import serve

from omnistage.config import EngineConfig
from omnistage.ray.metrics import BOARD_NAME, POST_INTERVAL_S, merged
from omnistage.server.options import ServerOptions, load_server

REPLICA_HEADER = b"x-omnistage-replica"
log = logging.getLogger(__name__)

Scope = dict[str, Any]


@serve.ingress()
class OmnistageReplica:
    """Serve's replica class: `__init__` loads (Serve counts the replica as started only once it returns, so a
    replica takes traffic once its engine is ready), `check_health` fails when the engine has stopped, and
    `__del__` shuts the engine down as Serve stops the replica."""

    def __init__(self, config: EngineConfig, options: ServerOptions) -> None:
        self._poster: asyncio.Task[None] | None = None
        self.replica = serve.get_replica_context().replica_id.unique_id
        # not `app`: Serve's wrapper has a property of that name
        self.pipeline, self.server = load_server(config, options)
        self.board = ray.get_actor(BOARD_NAME)
        self._local = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.server), base_url="http://replica"
        )
        log.info("replica %s serving\n  %s", self.replica, self.pipeline.memory_summary())

    def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: Scope, receive: Any, send: Any) -> None:  # a function: uvicorn sees ASGI 3
            await self.asgi(scope, receive, send)

        return app

    async def asgi(self, scope: Scope, receive: Any, send: Any) -> None:
        """The app, with the replica named on every response and `/metrics` answered for all replicas."""
        if self._poster is None:  # the replica's event loop runs by now
            self._poster = asyncio.get_running_loop().create_task(self._post_forever())
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            await self._all_metrics(send)
            return

        async def named(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.replica.encode())],
                }
            await send(message)

        await self.server(scope, receive, named)

    async def _all_metrics(self, send: Any) -> None:
        await self._post()
        body = merged(await self.board.texts.remote())
        headers = [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (REPLICA_HEADER, self.replica.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _post(self) -> None:
        """This replica's own exposition (the single server's `/metrics`) onto the board."""
        text = (await self._local.get("/metrics")).text
        await self.board.post.remote(self.replica, text)

    async def _post_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a board that is gone for a moment: the next post retries
                await self._post()
            await asyncio.sleep(POST_INTERVAL_S)

    def check_health(self) -> None:
        if not self.pipeline.ready:
            raise RuntimeError(f"replica {self.replica}: the engine is not running")

    def __del__(self) -> None:
        if self._poster is not None:
            self._poster.cancel()
        if hasattr(self, "pipeline"):  # it loaded
            self.pipeline.shutdown()
