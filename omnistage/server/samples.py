"""Several choices in one answer: `n` samples of a prompt, a list of prompts (`/v1/completions`), and `best_of`,
the `n` most likely of more samples.

The request is fanned out into one engine request per sample: its id is the parent's and the sample's number
(`cmpl-...-3`), its prompt ids are those of its prompt (the same for every sample of it, so that the prefix
cache can share the prompt's pages), and under a client's `seed` each sample draws under a seed of its own
derived from it, so that a seeded request is reproducible and its samples differ. The samples' streams are
merged into one answer, choices indexed prompt-major (prompt i's n choices at i * n ...), as OpenAI's; the
usage counts each prompt once and every sample's tokens. Closing the merged stream (a client gone, a failure)
aborts every sample still running.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omnistage.outputs import RequestOutput
from omnistage.request import GenerationRequest
from omnistage.server.formats import ChatFormat, CompletionFormat
from omnistage.server.responses import Usage
from omnistage.server.streaming import (
    EventStream,
    Responder,
    pipeline_call,
    raise_if_failed,
    sse_body,
    taken,
    unless_disconnected,
)


@dataclass(frozen=True)
class Sample:
    """One engine request of a fanned-out request, the format of its choice, and which prompt it samples."""

    request: GenerationRequest
    fmt: ChatFormat | CompletionFormat
    prompt: int = 0


def fan_out(parent: GenerationRequest, samples: int, first: int = 0) -> list[GenerationRequest]:
    """`samples` engine requests of `parent`'s prompt, numbered from `first` (ids `{parent}-{number}`); the
    i-th draws under `sample_seed(seed, i)`, and each tells admission how many samples run together."""
    params = parent.params
    return [
        replace(
            parent,
            request_id=f"{parent.request_id}-{first + i}",
            prompt_token_ids=list(parent.prompt_token_ids),
            params=replace(params, seed=sample_seed(params.seed, i), stop=list(params.stop or ())),
            samples=samples,
        )
        for i in range(samples)
    ]


def sample_seed(seed: int | None, i: int) -> int | None:
    """The seed of a prompt's i-th sample under the client's `seed`: the seed itself for the first, so that a
    request for one choice draws as before, and a hash of both for each other one (within int64)."""
    if seed is None or i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def cumulative_logprob(output: RequestOutput) -> float:
    """How likely the model found a sample: the sum of its tokens' logprobs."""
    return sum(lp.logprob for lp in output.outputs[0].logprobs or ())


async def merged(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several streams as they come, each with its stream's position; it ends once each stream
    has given its finished output. Closing it, or a stream's failure, closes every stream: the requests still
    running are aborted."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                output = task.result()
                yield i, output
                if not output.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class SampledAnswer:
    """The answer of one fanned-out request: its samples run together, answered whole or streamed."""

    def __init__(self, responder: Responder, endpoint: str, samples: list[Sample]) -> None:
        self.responder, self.endpoint, self.samples = responder, endpoint, samples
        self.id = samples[0].fmt.id
        self._prompt_tokens = sum(
            len(s.request.prompt_token_ids)
            for i, s in enumerate(samples)
            if i == 0 or s.prompt != samples[i - 1].prompt
        )
        self._generated = [0] * len(samples)

    def usage(self) -> Usage:
        """Each prompt once, and every sample's tokens so far."""
        return Usage.of(self._prompt_tokens, sum(self._generated))

    def _start(self, request: Request, stream: bool) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Hand every sample over, as Responder.start hands one."""
        responder = self.responder
        responder.metrics.prepared(getattr(request.state, "received", None))
        request.state.response_id = self.id
        preparing = getattr(request.state, "preparing", None)
        requests = [s.request if stream else replace(s.request, final_only=True) for s in self.samples]
        return merged([responder.pipeline.generate(r, preparing) for r in requests])

    async def respond(self, request: Request, stream: bool, keep: int | None = None) -> Response:
        """Run every sample and answer them. `keep`: of each prompt's samples, return only the `keep` most likely
        (best_of), most likely first; the usage counts them all."""
        outputs = self._start(request, stream)
        if stream:
            buffered = await pipeline_call(
                unless_disconnected(request, self._until_each_started(outputs)), outputs, self.id
            )
            delivered = buffered[0][1].metrics.get("delivered")
            return EventStream(
                self._events(outputs, buffered), lambda: self.responder.metrics.responded(delivered)
            )
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for i, output in outputs:
                self._generated[i] = len(output.outputs[0].token_ids)
                if output.finished:
                    finals[i] = output

        try:
            await pipeline_call(unless_disconnected(request, collect()), outputs, self.id)
        finally:
            for output in finals.values():
                self.responder.metrics.observe(output)
        for output in finals.values():
            raise_if_failed(output)
        body = self._whole(finals, keep)
        self.responder.count(self.endpoint, 200)
        return JSONResponse(body)

    def _whole(self, finals: dict[int, RequestOutput], keep: int | None) -> dict[str, Any]:
        """One response holding every choice: each sample's format spells its own, and the first's response
        carries them all."""
        chosen = list(range(len(self.samples)))
        if keep is not None:
            chosen = []
            for prompt in dict.fromkeys(s.prompt for s in self.samples):
                of_prompt = [i for i, s in enumerate(self.samples) if s.prompt == prompt]
                ranked = sorted(of_prompt, key=lambda i: cumulative_logprob(finals[i]), reverse=True)
                chosen += ranked[:keep]
        usage = self.usage()
        bodies = []
        for index, i in enumerate(chosen):
            fmt, output = self.samples[i].fmt, finals[i].outputs[0]
            fmt.index = index  # best_of: the kept samples' choices, numbered in their new order
            assert output.finish_reason is not None  # a finished output has its finish_reason
            bodies.append(fmt.response(output.text, output.finish_reason, usage, output.logprobs))
        whole = bodies[0]
        whole["choices"] = [choice for body in bodies for choice in body["choices"]]
        return whole

    async def _until_each_started(
        self, outputs: AsyncGenerator[tuple[int, RequestOutput], None]
    ) -> list[tuple[int, RequestOutput]]:
        """The outputs up to the first of every sample: a stream starts only once all are admitted, so that one
        refused is still a 4xx."""
        buffered, started = [], set()
        async for i, output in outputs:
            buffered.append((i, output))
            started.add(i)
            if len(started) == len(self.samples):
                break
        return buffered

    def _chunks(self, i: int, output: RequestOutput) -> list[str]:
        """The chunks of one sample's output; raises if the sample failed."""
        fmt, completion = self.samples[i].fmt, output.outputs[0]
        self._generated[i] = len(completion.token_ids)
        if fmt.continuous_usage:
            fmt.running_usage = self.usage()
        if not output.finished:
            return fmt.delta(completion.delta_text, None, completion.delta_logprobs)
        raise_if_failed(output)
        reason = completion.finish_reason
        assert reason is not None  # a finished output has its finish_reason
        return fmt.delta(completion.delta_text, reason, completion.delta_logprobs) + fmt.closing(reason)

    def _events(
        self,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
        buffered: list[tuple[int, RequestOutput]],
    ) -> AsyncGenerator[str, None]:
        """The SSE body: every choice's opening, the samples' chunks as they come, the usage if asked, then
        `[DONE]`. As in the single-choice stream (streaming.py), a failure sends what is pending before it."""
        last: dict[int, RequestOutput] = {}
        first = self.samples[0].fmt
        pending: list[str] = []

        async def sends() -> AsyncGenerator[str, None]:
            for s in self.samples:
                s.fmt.running_usage = self.usage() if s.fmt.continuous_usage else None
                pending.extend(s.fmt.opening())
            for i, output in buffered:
                last[i] = output
                pending.extend(self._chunks(i, output))
            yield taken(pending)
            async for i, output in outputs:
                last[i] = output
                pending.extend(self._chunks(i, output))
                if pending:
                    yield taken(pending)
            if first.include_usage:
                pending.append(first.usage_chunk(self.usage()))

        async def finished(status: int | str) -> None:
            await outputs.aclose()
            self.responder.count(self.endpoint, status)
            for output in last.values():
                self.responder.metrics.observe(output)

        return sse_body(sends(), pending, first, finished)
