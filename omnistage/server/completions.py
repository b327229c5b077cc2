"""`/v1/completions`: one raw prompt, text (the model's own notation, control tokens included) or token ids,
continued in text; with `echo`, the prompt's text comes before the reply."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import Response

from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest
from omnistage.server.formats import CompletionFormat
from omnistage.server.logprobs import CompletionLogprobsWriter, LazyTokenTexts
from omnistage.server.protocol.completions import CompletionRequest
from omnistage.server.streaming import Responder

PATH = "/v1/completions"


class CompletionsEndpoint:
    def __init__(self, responder: Responder, frontend: Frontend) -> None:
        self.responder, self.frontend = responder, frontend
        self.texts = LazyTokenTexts(frontend)

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        params = body.sampling_params(body.max_tokens)
        given = body.single_prompt()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        processor = self.frontend.processor
        if isinstance(given, str):
            ids = await asyncio.to_thread(processor.encode, given, self.frontend.max_model_len)
            new = GenerationRequest(request_id, ids, params, given)
        else:
            new = GenerationRequest(request_id, list(given), params)
        echo = ""
        if body.echo:  # the prompt as given, or its ids' text with their control tokens
            echo = (
                given
                if isinstance(given, str)
                else processor.tokenizer.decode(given, skip_special_tokens=False)
            )
        writer = CompletionLogprobsWriter(self.texts.get()) if params.logprobs is not None else None
        fmt = CompletionFormat(request_id, self.responder.served_model_name, body.include_usage, echo, writer)
        return await self.responder.respond(request, PATH, fmt, new, bool(body.stream))
