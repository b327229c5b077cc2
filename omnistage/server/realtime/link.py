"""What the parts of a realtime session read of their server (`Services`, shared by every session) and of their
session (`Link`: those, and the session's conversation and sending)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server.metrics import ServerMetrics
from omnistage.server.realtime.conversation import Conversation
from omnistage.server.voices import Voices

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Services:
    """What every session of a server shares."""

    pipeline: AsyncPipeline
    voices: Voices
    metrics: ServerMetrics
    max_conversation_tokens: int


@dataclass(frozen=True)
class Link:
    """What a response (or a transcription, an early prefill) reads of its session and its server."""

    pipeline: AsyncPipeline
    voices: Voices
    metrics: ServerMetrics
    send: Send
    conversation: Conversation
    max_conversation_tokens: int
