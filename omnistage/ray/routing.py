"""Which replica takes a request: the one holding its session, else the less loaded of two.

A request naming a session (Serve's session header, `x-session-id` unless RAY_SERVE_SESSION_ID_HEADER_KEY names
another) goes to the replica that a consistent-hash ring over the replicas gives its id, so a multi-turn chat's
turns meet the KV pages its earlier turns left in that replica's prefix cache (a busy replica makes it wait;
only one that has gone hands its sessions to the others). A request without a session goes to the less loaded of two replicas
drawn at random (Serve's default). A realtime WebSocket is one connection: all its turns stay on the replica
that accepted it, whatever the header.

The prompt itself cannot steer the choice: Serve's proxy routes an HTTP request before it reads the body.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica


class SessionRouter(ConsistentHashRouter):
    """Serve's consistent-hash router for requests with a session id, two random choices for the rest."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if not candidate_replicas:
            return []
        # one rank of two: Serve asks both for their queue lengths and takes the shorter
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


def router_config() -> dict[str, Any]:
    """The deployment option that installs SessionRouter, strict: a session waits for its own replica rather
    than move (only a replica that has gone takes its sessions off the ring)."""
    name = f"{SessionRouter.__module__}.{SessionRouter.__qualname__}"  # Serve's controller imports it by name
    return {
        "request_router_config": {
            "request_router_class": name,
            "request_router_kwargs": {"num_fallback_replicas": 0},
        }
    }
