"""`/v1/completions`: one raw prompt, text (the model's own notation, control tokens included) or token ids,
continued in text."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import Response

from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest
from omnistage.server.formats import CompletionFormat
from omnistage.server.protocol.completions import CompletionRequest
from omnistage.server.streaming import Responder

PATH = "/v1/completions"


class CompletionsEndpoint:
    def __init__(self, responder: Responder, frontend: Frontend) -> None:
        self.responder, self.frontend = responder, frontend

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        self.responder.begin(request, body.model)
        params = body.sampling_params(body.max_tokens)
        given = body.single_prompt()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if isinstance(given, str):
            processor, context = self.frontend.processor, self.frontend.max_model_len
            ids = await asyncio.to_thread(processor.encode, given, context)
            new = GenerationRequest(request_id, ids, params, given)
        else:
            new = GenerationRequest(request_id, list(given), params)
        fmt = CompletionFormat(request_id, self.responder.served_model_name, body.include_usage)
        return await self.responder.respond(request, PATH, fmt, new, bool(body.stream))
