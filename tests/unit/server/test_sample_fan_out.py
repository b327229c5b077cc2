"""A request fanned out into samples (server/samples.py): their ids and seeds, and their merged streams, which
close every sample's stream however they end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.request import GenerationRequest, SamplingParams
from omnistage.server.samples import fan_out, merged, sample_seed


def test_samples_share_the_prompt_and_draw_under_their_own_seeds():
    parent = GenerationRequest("cmpl-1", [5, 6, 7], SamplingParams(seed=7, stop="x"))
    children = fan_out(parent, 3, first=6)
    assert [c.request_id for c in children] == ["cmpl-1-6", "cmpl-1-7", "cmpl-1-8"]
    assert all(c.prompt_token_ids == [5, 6, 7] and c.samples == 3 for c in children)
    assert [c.params.seed for c in children] == [sample_seed(7, i) for i in range(3)]
    assert children[0].params.seed == 7 and len({c.params.seed for c in children}) == 3
    seeds = [sample_seed(-(2**63), i) for i in range(1, 16)]
    assert all(-(2**63) <= s < 2**63 for s in seeds) and len(set(seeds)) == 15
    assert [c.params.seed for c in fan_out(GenerationRequest("c", [1], SamplingParams()), 2)] == [None, None]


def output(request_id: str, step: int, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "x" * step, [1] * step, "stop" if finished else None)
    return RequestOutput(request_id, None, [1], [completion], finished)


async def stream(name: str, steps: int, closed: list[str], fail: bool = False) -> AsyncGenerator:
    try:
        for step in range(1, steps + 1):
            await asyncio.sleep(0)
            if fail and step == 2:
                raise RuntimeError(f"{name} failed")
            yield output(name, step, step == steps)
        await asyncio.sleep(3600)  # a stream ends at its finished output
    finally:
        closed.append(name)


def test_merged_streams_end_with_every_sample_finished():
    closed: list[str] = []

    async def run() -> list[tuple[int, int]]:
        streams = [stream("a", 2, closed), stream("b", 3, closed)]
        return [(i, len(o.outputs[0].token_ids)) async for i, o in merged(streams)]

    seen = asyncio.run(run())
    assert sorted(seen) == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    assert sorted(closed) == ["a", "b"]


def test_one_failing_or_closing_early_closes_every_stream():
    closed: list[str] = []

    async def failing() -> None:
        async for _ in merged([stream("a", 5, closed, fail=True), stream("b", 50, closed)]):
            pass

    with pytest.raises(RuntimeError, match="a failed"):
        asyncio.run(failing())
    assert sorted(closed) == ["a", "b"]

    closed.clear()

    async def leaving() -> None:
        outputs = merged([stream("c", 50, closed), stream("d", 50, closed)])
        await anext(outputs)
        await outputs.aclose()

    asyncio.run(leaving())
    assert sorted(closed) == ["c", "d"]
