"""The offline API, shaped like vLLM's: `LLM(...).generate(...)` and `.chat(...)` in-process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from omnistage.config import engine_config
from omnistage.engine.stages.text import TextStage
from omnistage.errors import InvalidRequest, OmnistageError
from omnistage.media import MediaPolicy, VideoOptions, decode_messages
from omnistage.outputs import RequestOutput
from omnistage.pipeline.family import build_pipeline
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams, talker_sampling_defaults

PromptType = str | dict
# In-process callers name their own files: local paths anywhere, nothing fetched from the network.
_OFFLINE_MEDIA = MediaPolicy(allow_remote=False, media_dir=Path("/"))


class RequestFailed(OmnistageError):
    """A prompt of an offline call failed inside the engine; the call's other prompts are abandoned."""


class LLM:
    """An engine in this process. `model=None` serves the embedded tiny checkpoint (random weights).

    Keyword arguments take the `serve` flags' names (device, dtype, page_size, num_kv_pages, max_num_seqs,
    ...: `config.flags`) and the schema's other top-level keys (stages, speech, ...), as `engine_config` does.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.pipeline = build_pipeline(engine_config(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def engine(self) -> TextStage:
        """The Thinker's stage: its pages, scheduler, runner and plan."""
        return self.pipeline.thinker

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is a string or {"prompt_token_ids": [...]} (or {"prompt": str}).

        Raises what keeps a prompt out of the engine (nothing runs then), and RequestFailed when a prompt fails
        inside it (a model step raised for it); chat does the same.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        requests = []
        for prompt, p in zip(prompts, params_list):
            text, token_ids = self._tokens(prompt)
            requests.append(
                GenerationRequest(str(next(self._ids)), token_ids, p, prompt=text, final_only=True)
            )
        return self._run(self._admit(requests))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        modalities: Sequence[str] = ("text",),
        voice: str = "ethan",
        talker_params: SamplingParams | None = None,
        use_audio_in_video: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the checkpoint's chat template.

        Content parts may carry media as the HTTP API takes them (`input_audio`, `audio_url`, `image_url`:
        data URLs or absolute local paths; no remote fetching offline) or already decoded (`{"type": "audio",
        "audio": float32 array at 16 kHz}`, `{"type": "image", "image": PIL.Image}`); a video as `{"type": "video",
        "video": path}` (mp4, webm, mov, mkv) or its frames already sampled at the processor's 2 fps (uint8
        [frames, height, width, 3]). `use_audio_in_video` interleaves each video's sound track with its frames,
        as Qwen3-Omni was trained (a video given as frames has none).
        With `modalities=["text", "audio"]` each reply is also spoken in `voice`: outputs carry `.audio` (float32
        mono PCM at 24 kHz) and `.audio_codes`; `talker_params` sets the Talker's sampling (default: the released
        model's) and `talker_params.max_tokens` the most codec frames (12.5 per second of audio).
        """
        batch = bool(messages) and isinstance(messages[0], list)
        conversations = cast(list[list[dict]], messages) if batch else [cast(list[dict], messages)]
        params = sampling_params or SamplingParams()
        if set(modalities) not in ({"text"}, {"text", "audio"}):
            raise InvalidRequest(f"modalities must be ['text'] or ['text', 'audio'], got {list(modalities)}")
        speech = None
        if "audio" in modalities:
            speech = SpeechParams(voice=voice, talker=talker_params or talker_sampling_defaults())
        requests = []
        for conversation in conversations:
            decoded = decode_messages(conversation, _OFFLINE_MEDIA, VideoOptions(use_audio_in_video))
            processed = self.pipeline.processor.process_chat(
                decoded, add_generation_prompt, use_audio_in_video=use_audio_in_video
            )
            requests.append(
                GenerationRequest(
                    str(next(self._ids)),
                    processed.token_ids,
                    params,
                    processed.prompt,
                    processed.mrope,
                    processed.mm,
                    speech,
                    final_only=True,
                )
            )
        return self._run(self._admit(requests))

    def _admit(self, requests: list[GenerationRequest]) -> list[str]:
        """Admit all the requests (their media encoded together) or none: the first error is raised."""
        errors = self.pipeline.add_requests(requests)
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            for request, error in zip(requests, errors):
                if error is None:
                    self.pipeline.abort(request.request_id)
            raise failed
        return [r.request_id for r in requests]

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.pipeline.processor.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return prompt["prompt"], self.pipeline.processor.encode(prompt["prompt"])

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        try:
            while self.pipeline.has_unfinished():
                for out in self.pipeline.step():
                    if out.finished:
                        final[out.request_id] = out
                    if out.error is not None and out.request_id in request_ids:
                        raise RequestFailed(
                            f"prompt {request_ids.index(out.request_id)} of {len(request_ids)} (counting from 0) "
                            f"failed in the engine: {out.error}"
                        )
        finally:
            for request_id in request_ids:
                if request_id not in final:
                    self.pipeline.abort(request_id)
        return [final[r] for r in request_ids]
