"""One request's failure never fails the others in its step: a failed batch runs again one chunk at a time.

A chunk run again rewrites the same KV slots (writes are idempotent), and the seeded generators of the batch
are first put back where they stood, so every other request gets exactly the tokens it would have got.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from omnistage.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

R = TypeVar("R")
Out = TypeVar("Out")
S = TypeVar("S")  # the stage's state of a request


def run_isolated(
    chunks: list[ScheduledChunk[S]],
    compute: Callable[[list[ScheduledChunk[S]]], R],
    apply: Callable[[list[ScheduledChunk[S]], R], list[Out]],
    fail: Callable[[ScheduledChunk[S], Exception], list[Out]],
    generators: Callable[[list[ScheduledChunk[S]]], list[torch.Generator]],
) -> list[Out]:
    """`apply(chunks, compute(chunks))`; if `compute` raises, `fail` for a lone chunk, else the same for each
    chunk alone. Only `compute` is retried: `apply` changes the scheduler's state and runs once."""
    saved = [(g, g.get_state()) for g in generators(chunks)]
    try:
        result = compute(chunks)
    except Exception as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        if len(chunks) == 1:
            return fail(chunks[0], exc)
        log.warning("a step of %d chunks failed (%s); running them one at a time", len(chunks), exc)
        for generator, state in saved:
            generator.set_state(state)
        return [out for chunk in chunks for out in run_isolated([chunk], compute, apply, fail, generators)]
    return apply(chunks, result)
