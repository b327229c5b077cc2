"""The one interface of a family's pipeline, and its Frontend: what the server may know of it.

A family's pipeline (qwen3_omni.py, qwen3_asr.py) composes its stages behind `Pipeline`, which a StepLoop drives
a step at a time (step_loop.py), on a thread of the caller's process or in an engine process of its own; there
the caller's process reads it as a `PipelineView` (engine_process.py). AsyncPipeline (async_pipeline.py) feeds
either from asyncio. The server talks to AsyncPipeline and reads nothing of the pipeline but its `Frontend`,
handed over once with it: how a prompt is laid out, the context, the voices, the memory plan's gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer

from omnistage.config import EngineConfig
from omnistage.engine.memory.gauges import GAUGE_HELP, Gauge
from omnistage.models.qwen3_omni.processor import ProcessedPrompt
from omnistage.models.qwen3_omni.transcription import language_name
from omnistage.outputs import RequestOutput
from omnistage.request import GenerationRequest, ValidRequest


@dataclass(frozen=True)
class TtsPrompt:
    """A text-to-speech request: the prompt the Talker is conditioned on, and the reply it speaks."""

    prompt: str
    token_ids: list[int]
    reply_token_ids: list[int]


class PromptProcessor(Protocol):
    """What the server asks of a family's processor: the prompt of a raw text, of a chat (its media decoded by
    `omnistage.media`) or of a clip to transcribe, the text of token ids, and the transcript in the model's
    reply. With `max_model_len`, text that cannot fit the context is refused before it is tokenized;
    `use_audio_in_video` interleaves each video's sound track with its frames; `template_kwargs` are the
    request's `chat_template_kwargs`, more variables for the chat template; `tools` (OpenAI's tool definitions)
    go to the chat template, which renders them where `renders_tools`. `tokenizer` spells the tokens of
    logprobs."""

    renders_tools: bool

    @property
    def tokenizer(self) -> Tokenizer: ...

    def encode(self, text: str, max_model_len: int | None = None, /) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, /) -> str: ...

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        /,
    ) -> tuple[str, list[int]]: ...

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        use_audio_in_video: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        /,
    ) -> ProcessedPrompt: ...

    def transcription(
        self, audio: np.ndarray, language: str | None, prompt: str | None, max_model_len: int | None = None, /
    ) -> ProcessedPrompt:
        """The prompt of transcribing `audio` (16 kHz mono), its `max_tokens` the cap of the clip's length."""
        ...

    def translation(
        self, audio: np.ndarray, prompt: str | None, max_model_len: int | None = None, /
    ) -> ProcessedPrompt:
        """The prompt of translating the speech in `audio` into English text; an InvalidRequest where the model
        cannot translate."""
        ...

    def transcript(self, text: str, /) -> tuple[str | None, str]:
        """The language the reply names (None where it names none) and the transcript in it."""
        ...


@dataclass(frozen=True)
class Frontend:
    """What the server may know of a pipeline: how a prompt is laid out (`processor`, within `max_model_len`),
    how a text is spoken (`tts_prompt`, in one of `voices`), and the memory plan. Nothing in it runs model
    work; the server gets it once, from AsyncPipeline.frontend."""

    model_path: Path
    max_model_len: int
    processor: PromptProcessor
    tts_prompt: Callable[[str], TtsPrompt]  # the prompt and reply of speaking a text exactly
    voices: tuple[str, ...] = ()  # the released speakers' names, lower case; empty where it cannot speak
    plan_gauges: tuple[Gauge, ...] = ()  # every device's memory plan as gauge samples (none on a CPU)

    @property
    def plan_gauge_help(self) -> Mapping[str, str]:
        """The help text of each of `plan_gauges`' names."""
        return GAUGE_HELP

    def language_name(self, language: str | None) -> str | None:
        """A client's language code as the model names the language ('en' -> 'English'; else as given)."""
        return language_name(language)


class PipelineView(Protocol):
    """A pipeline as its caller reads it, in this process or in another: its Frontend, stats and plan."""

    @property
    def frontend(self) -> Frontend: ...

    @property
    def num_waiting(self) -> int:
        """Requests not started yet."""
        ...

    def stats(self) -> dict[str, int]:
        """Counts for /metrics: num_waiting, num_running, kv_pages_total/used/free, a speaking family's more."""
        ...

    def memory_summary(self) -> str:
        """The start-up summary: each stage's weights, KV pool and graphs."""
        ...


class Pipeline(PipelineView, Protocol):
    """A family's stages behind one interface, stepped by a StepLoop: requests in, RequestOutputs out."""

    config: EngineConfig

    def validate(self, request: GenerationRequest) -> ValidRequest:
        """Check a request, once, against what only the stages know (the context, the vocabulary, the page
        pools, the voices); raise what makes it unservable. Nothing after it checks the request again."""
        ...

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[Exception | None]:
        """Admit several requests, their media encoded together; each is validated once, here (`validate`).
        Per request: None, or what kept it out (nothing of it is left behind)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One step of every stage with work: the outputs of the requests it touched."""
        ...

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is, freeing what it held; its final output, if it was known."""
        ...

    def has_unfinished(self) -> bool: ...
