"""`/v1/completions`: raw prompts, each text (the model's own notation, control tokens included) or token ids,
continued in text; with `echo`, the prompt's text comes before the reply. Several prompts, `n` and `best_of`
are answered as several choices of one response (samples.py)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest
from omnistage.server.formats import CompletionFormat
from omnistage.server.logprobs import CompletionLogprobsWriter, LazyTokenTexts
from omnistage.server.protocol.completions import CompletionRequest
from omnistage.server.samples import Sample, SampledAnswer, fan_out
from omnistage.server.streaming import Responder

PATH = "/v1/completions"


class CompletionsEndpoint:
    def __init__(self, responder: Responder, frontend: Frontend) -> None:
        self.responder, self.frontend = responder, frontend
        self.texts = LazyTokenTexts(frontend)

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        params = body.sampling_params(body.max_tokens)
        prompts, samples = body.prompts(), body.samples()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if samples > body.choices:  # best_of ranks its samples by the sum of their tokens' logprobs
            params = replace(params, logprobs=params.logprobs or 0)
        processor = self.frontend.processor
        laid_out = []
        for given in prompts:
            if isinstance(given, str):
                ids = await asyncio.to_thread(processor.encode, given, self.frontend.max_model_len)
                laid_out.append(GenerationRequest(request_id, ids, params, given))
            else:
                laid_out.append(GenerationRequest(request_id, list(given), params))

        def format_of(given: str | list[int], index: int) -> CompletionFormat:
            echo = ""
            if body.echo:  # the prompt as given, or its ids' text with their control tokens
                echo = (
                    given
                    if isinstance(given, str)
                    else processor.tokenizer.decode(given, skip_special_tokens=False)
                )
            writer = CompletionLogprobsWriter(self.texts.get()) if body.logprobs is not None else None
            name, usage = self.responder.served_model_name, body.include_usage
            return CompletionFormat(
                request_id, name, usage, echo, writer, index=index, continuous_usage=body.continuous_usage
            )

        if len(prompts) == 1 and samples == 1:
            return await self.responder.respond(
                request, PATH, format_of(prompts[0], 0), laid_out[0], bool(body.stream)
            )
        fanned = [
            Sample(child, format_of(given, p * samples + i), p)
            for p, (given, parent) in enumerate(zip(prompts, laid_out, strict=True))
            for i, child in enumerate(fan_out(parent, samples, p * samples))
        ]
        keep = body.choices if samples > body.choices else None
        return await SampledAnswer(self.responder, PATH, fanned).respond(request, bool(body.stream), keep)
