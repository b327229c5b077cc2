"""Qwen3-Omni's stages wired together: the encoders and Thinker (a TextStage), then, for a request that
speaks, the Talker, the code predictor and streaming Code2Wav (`speech_stages.py`), the text and frames handed
across them step by step (`handoff.py`). The one facade the server and the offline `LLM` talk to: requests in,
`RequestOutput`s out, text and audio side by side."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from omnistage.config import STAGES, EngineConfig
from omnistage.engine.devices import resolve_device, resolve_dtype
from omnistage.engine.memory.gauges import plan_gauges
from omnistage.engine.memory.plan import MemoryPlan
from omnistage.engine.stages.text import TextStage
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.talker_input import TtsEmbeds, text_rows, tts_embeds
from omnistage.outputs import RequestOutput
from omnistage.pipeline.handoff import Speech
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni_loading import load_thinker_stage, omni_frontend, thinker_settings
from omnistage.pipeline.qwen3_omni_speech import (
    ASSISTANT_ROWS,
    failed,
    max_speaking,
    new_speech,
    validate_speech,
)
from omnistage.pipeline.qwen3_omni_step import OmniStep
from omnistage.pipeline.samples import validate_text
from omnistage.pipeline.speaking_queue import SpeakingQueue
from omnistage.pipeline.speech_stages import SpeechStages
from omnistage.pipeline.topology import validate_topology
from omnistage.request import (
    MAX_AUDIO_FRAMES,
    GenerationRequest,
    ValidRequest,
)


class Qwen3OmniPipeline:
    """Qwen3-Omni's stages behind the Pipeline interface (base.py): the requests in and out here, the stages'
    step in `steps` (qwen3_omni_step.py), the speaking requests beyond max_speaking in `queue`."""

    def __init__(self, config: EngineConfig) -> None:
        from omnistage.models.qwen3_omni.tiny import default_checkpoint

        self.config = config
        path = Path(config.model) if config.model else default_checkpoint()
        self.model_config = Qwen3OmniConfig.from_dir(path)
        self.speaks = config.speech and self.model_config.enable_audio_output
        self._place()
        shared = self.speech_device == self.device
        self.speech_stages = self._load_speech_stages(path, shared) if self.speaks else None
        self.processor = Processor(path)
        self.tokenizer = self.processor.tokenizer
        self.thinker, talker_tables = self._load_thinker(path)
        self.plans = self._plan(shared)
        self.model_path, self.max_model_len = self.thinker.model_path, self.thinker.context_tokens
        self._speaking: dict[str, Speech] = {}
        # speaking requests beyond max_speaking wait there, in arrival order; text requests never do
        self.queue = SpeakingQueue(max_speaking(config, self.speech_device))
        self.steps = OmniStep(
            self.thinker,
            self.speech_stages,
            self._speaking,
            self.model_config,
            talker_tables,
            config.overlap_stages,
        )
        gauges = tuple(gauge for plan in self.plans.values() for gauge in plan_gauges(plan))
        self.frontend = omni_frontend(
            self.processor, self.model_path, self.max_model_len, self.voices, gauges
        )

    def _place(self) -> None:
        """The stages' devices, checked against the machine, and the Thinker's dtype. The two-GPU topology puts
        the speech stages on a device of their own (hand-offs cross with .to)."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        validate_topology(self.config, gpus, stages=STAGES if self.speaks else STAGES[:2])
        self.device = resolve_device(self.config.stage("thinker").device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.speech_device = resolve_device(self.config.stage("talker").device)

    def _load_speech_stages(self, path: Path, shared: bool) -> SpeechStages:
        """The Talker, code predictor and Code2Wav, the Talker's pool sized for its longest sequence: the user
        turns of the longest prompt, its assistant rows and the audio cap."""
        text = self.model_config.thinker.text
        positions = text.max_position_embeddings
        thinker_len = min(self.config.max_model_len or positions, positions)
        max_len = thinker_len + ASSISTANT_ROWS + MAX_AUDIO_FRAMES
        speaking = max_speaking(self.config, self.speech_device)
        return SpeechStages(self.config, path, self.model_config, self.dtype, max_len, shared, speaking)

    def _load_thinker(self, path: Path) -> tuple[TextStage, tuple[TtsEmbeds, torch.Tensor] | None]:
        """The Thinker and its encoders, and where the pipeline speaks, the Talker's tables of the Thinker's
        embeddings (`_talker_tables`)."""
        models = load_thinker_stage(
            self.config, path, self.model_config, self.processor, self.device, self.dtype
        )
        talker_tables = None
        if self.speech_stages is not None:
            # the Talker reads these hidden states of a spoken reply's media rows (`new_speech`)
            models = replace(models, tap_layer=self.model_config.talker.accept_hidden_layer)
            # before the devices are read for their plans: the table is the speech stages' resident memory
            talker_tables = self._talker_tables(models.model.model.embed_tokens)
        return TextStage(thinker_settings(self.config), models, self.device, self.dtype), talker_tables

    def _talker_tables(self, embedding: torch.nn.Embedding) -> tuple[TtsEmbeds, torch.Tensor]:
        """The Talker's embeddings of its TTS tokens and its table of projected text rows (talker_input)."""
        assert self.speech_stages is not None
        with torch.inference_mode(), self.speech_stages.on_device():
            tts = tts_embeds(self.speech_stages.talker, embedding, self.speech_stages.tokens)
            return tts, text_rows(self.speech_stages.talker, embedding)

    @property
    def voices(self) -> tuple[str, ...]:
        """The released speakers' names (lower case); empty when this pipeline cannot speak."""
        return tuple(sorted(self.speech_stages.tokens.speakers)) if self.speech_stages is not None else ()

    def _plan(self, shared: bool) -> dict[torch.device, MemoryPlan]:
        """Each GPU's plan, for every stage on it at once, and each stage's grant taken: the Thinker's first,
        whose main-stream graph pool the speech stages join on a device they share with it."""
        needs = [(self.thinker.device, self.thinker.memory())] if self.thinker.device.type == "cuda" else []
        speech = self.speech_stages
        if speech is not None and speech.device.type == "cuda":
            with speech.on_device():
                needs.append((speech.device, speech.memory()))
        plans = plan_devices(needs, self.config.gpu_memory_limit_gib)
        if self.thinker.device in plans:
            self.thinker.allocate(plans[self.thinker.device])
        if speech is not None and speech.device in plans:
            with speech.on_device():
                speech.allocate(plans[speech.device], self.thinker.graph_pool if shared else None)
        return plans

    def memory_summary(self) -> str:
        summary = self.thinker.memory_summary()
        if self.speech_stages is None:
            return f"{summary}; speech off"
        return f"{summary}; {self.speech_stages.summary()}"

    # -- requests -----------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> ValidRequest:
        """Check a request against every stage it needs, once: what admits it trusts the ValidRequest."""
        if request.speech is None:
            return validate_text(self.thinker, request)
        return validate_speech(self.speech_stages, self.thinker, request, request.speech)

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[Exception | None]:
        """Admit several requests (their media encoded together); per request, None or what kept it out. Each
        is validated once, here; a speaking request then waits its turn if max_speaking already speak."""
        errors: list[Exception | None] = [None] * len(requests)
        index = {r.request_id: i for i, r in enumerate(requests)}
        text_requests = []
        for i, r in enumerate(requests):
            try:
                valid = self.validate(r)
            except Exception as exc:
                errors[i] = exc
                continue
            if r.speech is None:
                text_requests.append(valid)
            else:
                self.queue.push(valid, time.monotonic())
        for request_id, error in self._admit(text_requests, set(index)).items():
            errors[index[request_id]] = error
        return errors

    def _admit(
        self, text_requests: list[ValidRequest], batch: Collection[str] = frozenset()
    ) -> dict[str, Exception]:
        """Text requests, and the waiting speaking ones while fewer than max_speaking speak, to the Thinker in
        one call; what kept out each of `batch` (the ids being added). One refused that waited from an earlier
        batch ends in the next step's outputs."""
        thinker_requests = [NewRequest.of(valid) for valid in text_requests]
        while (turn := self.queue.next_turn(len(self._speaking))) is not None:
            r = turn.valid.request
            assert r.speech is not None and self.speech_stages is not None  # only speaking requests wait
            speech = new_speech(
                self.speech_stages,
                self.model_config,
                self.processor,
                r,
                turn.valid.max_tokens,
                turn.arrival,
                self.device,
                self.dtype,
            )
            if r.speech.reply_token_ids is None:
                thinker_requests.append(NewRequest.of(turn.valid, speech.tap))
            self._speaking[r.request_id] = speech
        errors = {}
        for r, error in zip(
            thinker_requests, self.thinker.add_requests(thinker_requests) if thinker_requests else []
        ):
            if error is None:
                continue
            refused = self._speaking.pop(r.request_id, None)
            if r.request_id in batch:
                errors[r.request_id] = error
            elif refused is not None:
                self.queue.refused.append(failed(refused.text, f"{type(error).__name__}: {error}"))
        return errors

    def abort(self, request_id: str) -> RequestOutput | None:
        waited = self.queue.abort(request_id)
        if waited is not None:
            return waited
        speech = self._speaking.pop(request_id, None)
        if speech is not None and self.speech_stages is not None:
            self.speech_stages.talker_stage.abort(request_id)
            self.speech_stages.streamer.cancel(request_id)
        out = self.thinker.abort(request_id)
        if out is None and speech is not None:
            completion = replace(
                speech.text.outputs[0],
                finish_reason="abort",
                delta_text="",
                delta_token_ids=[],
                delta_logprobs=[],
            )
            out = replace(speech.text, outputs=[completion], finished=True)
        return out

    def has_unfinished(self) -> bool:
        return self.thinker.has_unfinished() or bool(self._speaking or self.queue or self.queue.refused)

    @property
    def num_waiting(self) -> int:
        """Requests not started: the Thinker's, and the speaking ones waiting for their turn."""
        return self.thinker.num_waiting + len(self.queue)

    def stats(self) -> dict[str, int]:
        stats = self.thinker.stats()
        stats["num_waiting"] = self.num_waiting
        if self.speech_stages is not None:
            pool = self.speech_stages.talker_stage.pool
            stats |= {
                "talker_kv_pages_total": pool.num_pages,
                "talker_kv_pages_free": pool.num_free,
                "talker_prefix_cache_queries": pool.queried_tokens,
                "talker_prefix_cache_hits": pool.hit_tokens,
                "num_speaking": len(self._speaking),
            }
        return stats

    def step(self) -> list[RequestOutput]:
        """The waiting speaking requests whose turn came to the Thinker, then one step of the stages
        (`OmniStep.step`); those the Thinker refused since the last step come out first."""
        if self.queue.has_turn(len(self._speaking)):
            self._admit([])
        return self.queue.take_refused() + self.steps.step()
