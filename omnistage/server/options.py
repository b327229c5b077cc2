"""What a server is besides its engine: its name, key, limits, media policy and spoken-answer store, and the one
place a pipeline and its app are built from them (by `omnistage serve` and by each Ray Serve replica)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI

from omnistage.config import EngineConfig
from omnistage.media import MediaPolicy
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server.app import build_app
from omnistage.server.gate import DEFAULT_MAX_BODY_BYTES
from omnistage.server.realtime.route import RealtimeLimits
from omnistage.server.reasoning import AUTO
from omnistage.server.responses_api import DEFAULT_MAX_RESPONSES, ResponseStore
from omnistage.server.spoken_answers import DEFAULT_MAX_ANSWERS, DEFAULT_RETENTION_S, SpokenAnswers


@dataclass(frozen=True)
class ServerOptions:
    """The serve command's settings that are not the engine's (plain data: a Ray replica receives a copy)."""

    served_model_name: str
    api_key: str | None = None
    max_queue: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    media: MediaPolicy = field(default_factory=MediaPolicy)
    spoken_answers_retention_s: int = DEFAULT_RETENTION_S
    max_spoken_answers: int = DEFAULT_MAX_ANSWERS
    responses_retention_s: int = DEFAULT_RETENTION_S
    max_stored_responses: int = DEFAULT_MAX_RESPONSES
    engine_process: bool = False
    playground: bool = True  # the page at / and /playground
    reasoning_parser: str = AUTO  # server/reasoning.py
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)  # /v1/realtime's sessions


def load_server(config: EngineConfig, options: ServerOptions) -> tuple[AsyncPipeline, FastAPI]:
    """The pipeline `config` describes, loaded, and the app serving it; the caller shuts the pipeline down."""
    if options.engine_process:  # the server's torch work is then per request, on worker threads
        import torch

        from omnistage.pipeline.engine_process import ONE_THREAD

        torch.set_num_threads(ONE_THREAD)
    pipeline = AsyncPipeline.from_config(
        config, max_queue=options.max_queue, engine_process=options.engine_process
    )
    try:
        app = build_app(
            pipeline,
            options.served_model_name,
            api_key=options.api_key,
            max_body_bytes=options.max_body_bytes,
            media=options.media,
            voice_aliases=config.voice_aliases,
            answers=SpokenAnswers(options.spoken_answers_retention_s, options.max_spoken_answers),
            responses=ResponseStore(options.responses_retention_s, options.max_stored_responses),
            playground=options.playground,
            reasoning_parser=options.reasoning_parser,
            realtime=options.realtime,
        )
    except BaseException:
        pipeline.shutdown()
        raise
    return pipeline, app
