"""Qwen3-Omni's stages wired together: the encoders and Thinker (a TextStage), then, for a request that
speaks, the Talker, the code predictor and streaming Code2Wav (`speech_stages.py`), the text and frames handed
across them step by step (`handoff.py`). The one facade the server and the offline `LLM` talk to: requests in,
`RequestOutput`s out, text and audio side by side."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from omnistage.config import STAGES, EngineConfig
from omnistage.engine.devices import resolve_device, resolve_dtype
from omnistage.engine.memory.gauges import plan_gauges
from omnistage.engine.memory.plan import MemoryPlan
from omnistage.engine.stages.text import NewRequest, TextStage
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.talker_input import TtsEmbeds, text_rows, tts_embeds
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.handoff import Handoff, Speech
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni_loading import load_thinker_stage, omni_frontend
from omnistage.pipeline.qwen3_omni_speech import (
    ASSISTANT_ROWS,
    default_frame_cap,
    failed,
    max_speaking,
    new_speech,
    speech_output,
    validate_speech,
)
from omnistage.pipeline.side_stream import SideStream
from omnistage.pipeline.speech_stages import SpeechStages
from omnistage.pipeline.topology import validate_topology
from omnistage.request import (
    MAX_AUDIO_FRAMES,
    GenerationRequest,
    ValidRequest,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Waiting:
    """A speaking request validated and waiting for its turn (`max_speaking`)."""

    valid: ValidRequest
    arrival: float


class Qwen3OmniPipeline:
    """Qwen3-Omni's stages behind the Pipeline interface (base.py)."""

    def __init__(self, config: EngineConfig) -> None:
        from omnistage.models.qwen3_omni.tiny import default_checkpoint

        self.config = config
        path = Path(config.model) if config.model else default_checkpoint()
        self.model_config = cfg = Qwen3OmniConfig.from_dir(path)
        self.speaks = config.speech and cfg.enable_audio_output
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        validate_topology(config, gpus, stages=STAGES if self.speaks else STAGES[:2])
        device = resolve_device(config.stage("thinker").device)
        dtype = resolve_dtype(config.dtype, device)
        text = cfg.thinker.text
        thinker_len = min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        # the two-GPU topology: the speech stages on a device of their own (hand-offs cross with .to)
        self.speech_device = resolve_device(config.stage("talker").device)
        shared = self.speech_device == device
        self.speech_stages: SpeechStages | None = None
        if self.speaks:
            # the longest Talker sequence: the user turns of the longest prompt, its assistant rows, the audio cap
            self.speech_stages = SpeechStages(
                config, path, cfg, dtype, thinker_len + ASSISTANT_ROWS + MAX_AUDIO_FRAMES, shared
            )
        processor = Processor(path)
        thinker_stage = load_thinker_stage(config, path, cfg, processor, device, dtype)
        if self.speech_stages is not None:
            # the Talker reads these hidden states of a spoken reply's media rows (`new_speech`)
            thinker_stage = replace(thinker_stage, tap_layer=cfg.talker.accept_hidden_layer)
            # before the devices are read for their plans: the table is the speech stages' resident memory
            tts, table = self._talker_tables(thinker_stage.model.model.embed_tokens)
        self.thinker = TextStage(config, thinker_stage, device, dtype)
        self.plans = self._plan(shared)
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.model_path, self.max_model_len = self.thinker.model_path, self.thinker.max_model_len
        self.device, self.dtype = device, dtype
        self._speaking: dict[str, Speech] = {}
        # speaking requests beyond max_speaking wait here, in arrival order; text requests never do
        self.max_speaking = max_speaking(config, self.speech_device)
        self._waiting: deque[_Waiting] = deque()
        self._refused: list[RequestOutput] = []  # waiting requests the Thinker refused when their turn came
        # on a GPU the Thinker has a stream of its own, for its steps beside the speech stages' (`step`) when
        # overlap_stages is on (speech_profile.py times both ways)
        self._thinker_side = SideStream(device, "thinker") if self.speaks and device.type == "cuda" else None
        self.overlap = config.overlap_stages
        if self.overlap and self._thinker_side is not None:
            self.thinker.decode_ahead = False  # its steps beside are overlapped already, on a thread
            log.warning(
                "overlap_stages: the Thinker's steps run beside the speech stages'; on an H200 with driver "
                "580.159.04 a process so run stalled for minutes (README, 'Speech out')"
            )
        self._deferred_aborts: list[str] | None = None  # while a Thinker step runs beside: aborts wait for it
        if self.speech_stages is not None:
            self.handoff = Handoff(
                self.speech_stages, tts, self._embedding, table, device, cfg, self._speaking, self._fail
            )
        gauges = tuple(gauge for plan in self.plans.values() for gauge in plan_gauges(plan))
        self.frontend = omni_frontend(
            self.processor, self.model_path, self.max_model_len, self.voices, gauges
        )

    def _talker_tables(self, embedding: torch.nn.Embedding) -> tuple[TtsEmbeds, torch.Tensor]:
        """The Talker's embeddings of its TTS tokens and its table of projected text rows (talker_input)."""
        assert self.speech_stages is not None
        with torch.inference_mode(), self.speech_stages.on_device():
            tts = tts_embeds(self.speech_stages.talker, embedding, self.speech_stages.tokens)
            return tts, text_rows(self.speech_stages.talker, embedding)

    @property
    def _embedding(self) -> torch.nn.Embedding:
        return self.thinker.model.model.embed_tokens

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
            return ValidRequest(request, self.thinker.validate(request.prompt_token_ids, request.params))
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
                self._waiting.append(_Waiting(valid, time.monotonic()))
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
        while self._waiting and len(self._speaking) < self.max_speaking:
            waiting = self._waiting.popleft()
            r = waiting.valid.request
            assert r.speech is not None and self.speech_stages is not None  # only speaking requests wait
            speech = new_speech(
                self.speech_stages,
                self.model_config,
                self.processor,
                r,
                waiting.valid.max_tokens,
                waiting.arrival,
                self.device,
                self.dtype,
            )
            if r.speech.reply_token_ids is None:
                thinker_requests.append(NewRequest.of(waiting.valid, speech.tap))
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
                self._refused.append(failed(refused.text, f"{type(error).__name__}: {error}"))
        return errors

    def abort(self, request_id: str) -> RequestOutput | None:
        for waiting in self._waiting:
            if waiting.valid.request.request_id == request_id:
                self._waiting.remove(waiting)
                r = waiting.valid.request
                text = RequestOutput(
                    r.request_id, r.prompt, r.prompt_token_ids, [CompletionOutput(0, "", [])]
                )
                return replace(text, outputs=[replace(text.outputs[0], finish_reason="abort")], finished=True)
        speech = self._speaking.pop(request_id, None)
        if speech is not None and self.speech_stages is not None:
            self.speech_stages.talker_stage.abort(request_id)
            self.speech_stages.streamer.cancel(request_id)
        out = self.thinker.abort(request_id)
        if out is None and speech is not None:
            completion = replace(
                speech.text.outputs[0], finish_reason="abort", delta_text="", delta_token_ids=[]
            )
            out = replace(speech.text, outputs=[completion], finished=True)
        return out

    def has_unfinished(self) -> bool:
        return self.thinker.has_unfinished() or bool(self._speaking or self._waiting or self._refused)

    @property
    def num_waiting(self) -> int:
        """Requests not started: the Thinker's, and the speaking ones waiting for their turn."""
        return self.thinker.num_waiting + len(self._waiting)

    def stats(self) -> dict[str, int]:
        stats = self.thinker.stats()
        stats["num_waiting"] = self.num_waiting
        if self.speech_stages is not None:
            pool = self.speech_stages.talker_stage.pool
            stats |= {
                "talker_kv_pages_total": pool.num_pages,
                "talker_kv_pages_free": pool.num_free,
                "num_speaking": len(self._speaking),
            }
        return stats

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """A Thinker step, then a speaking step on the text known so far. On a GPU, once every speaking request's
        Talker runs, the two run at once (`side_stream.py`), the Talker reading the text of the steps before:
        it is a step behind the Thinker anyway (row k is token k + 1). Before that, the Thinker's step comes
        first, so that a new request's Talker starts on its first token in the same step."""
        if self._waiting and len(self._speaking) < self.max_speaking:
            self._admit([])
        outputs, self._refused = self._refused, []
        touched: dict[str, Speech] = {}
        beside = None
        if self.thinker.has_unfinished():
            if self._beside():
                assert self._thinker_side is not None  # `_beside` says there is one
                self._deferred_aborts = []
                beside = self._thinker_side.submit(self.thinker.step)
            else:
                self._on_thinker(self._thinker_step(), outputs, touched)
        try:
            chunks = self._speak() if self._speaking else {}
        finally:  # the Thinker's step ends before anything else touches it, also when the speaking step raised
            thinker_outputs = self._join(beside) if beside is not None else []
        self._on_thinker(thinker_outputs, outputs, touched)
        for request_id, speech in self._speaking.items():
            if request_id in chunks or speech.finished:
                touched[request_id] = speech
        for request_id, speech in touched.items():
            outputs.append(speech_output(speech, chunks.get(request_id, [])))
            if speech.finished:
                self._speaking.pop(request_id, None)
        return outputs

    def _join(self, beside: Future[list[RequestOutput]]) -> list[RequestOutput]:
        """The Thinker's step beside, then the aborts that waited for it (also when it raised)."""
        assert self._thinker_side is not None
        try:
            return self._thinker_side.join(beside)
        finally:
            aborts, self._deferred_aborts = self._deferred_aborts, None
            for request_id in aborts or []:
                self.thinker.abort(request_id)

    def _beside(self) -> bool:
        """Whether this step's Thinker step runs beside the speaking step: every Talker has started, and the
        Thinker's step replays a decode graph, which allocates little on the side stream (side_stream.py).
        Its eager steps (prefills) also call the layers torch.compile wraps, as the Talker's eager steps do:
        dynamo's caches of one code object are not entered from two threads."""
        return (
            self._thinker_side is not None
            and self.overlap
            and bool(self._speaking)
            and all(s.talker_started or s.error is not None for s in self._speaking.values())
            and self.thinker.replays_next_step()
        )

    def _thinker_step(self) -> list[RequestOutput]:
        outputs = self.thinker.step()
        if self._thinker_side is not None:  # a Thinker step beside starts after this one's KV writes
            self._thinker_side.mark()
        return outputs

    def _on_thinker(
        self, thinker_outputs: list[RequestOutput], outputs: list[RequestOutput], touched: dict[str, Speech]
    ) -> None:
        """A Thinker step's outputs: text-only ones go out as they are; a speaking request's update its text."""
        for out in thinker_outputs:
            speech = self._speaking.get(out.request_id)
            if speech is None:
                outputs.append(out)
                continue
            if speech.error is None:  # one failed meanwhile, in the speaking step beside, keeps its error
                self._on_text(speech, out)
            touched[out.request_id] = speech

    def _on_text(self, speech: Speech, out: RequestOutput) -> None:
        assert self.speech_stages is not None  # a speaking request's text
        completion = out.outputs[0]
        speech.text = out
        speech.generated = completion.token_ids
        if not out.finished:
            return
        speech.text_done = True
        if completion.finish_reason in ("error", "abort"):
            self._fail(speech, out.error or f"the reply's text ended with {completion.finish_reason}")
            return
        if speech.params.talker.max_tokens is None:  # the cap follows the text, now that its length is known
            speech.frame_cap = min(speech.frame_cap, default_frame_cap(max(0, len(speech.generated) - 1)))
            if (
                speech.talker_started
                and not speech.talker_done
                and self.speech_stages.talker_stage.cap(speech.request_id, speech.frame_cap)
            ):
                self.handoff.end_talker(speech)

    def _fail(self, speech: Speech, error: str) -> None:
        assert self.speech_stages is not None  # a speaking request's failure
        speech.error = error
        if self._deferred_aborts is not None:  # the Thinker is mid-step on its thread
            self._deferred_aborts.append(speech.request_id)
        else:
            self.thinker.abort(speech.request_id)
        self.speech_stages.talker_stage.abort(speech.request_id)
        self.speech_stages.streamer.cancel(speech.request_id)

    def _speak(self) -> dict[str, list[np.ndarray]]:
        assert self.speech_stages is not None  # requests speak
        with torch.inference_mode(), self.speech_stages.on_device():
            return self.handoff.step()
