"""Qwen3-ASR's stages: the audio encoder and the dense decoder, one text stage, behind the Pipeline interface
as Qwen3-Omni's (it transcribes; it does not speak)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from omnistage.config import STAGES, EngineConfig
from omnistage.engine.attention import backend_for
from omnistage.engine.devices import resolve_device, resolve_dtype
from omnistage.engine.memory.gauges import Gauge, plan_gauges
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.text import TextStage
from omnistage.engine.stages.text_setup import NewRequest, StageModels
from omnistage.errors import InvalidRequest
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_asr.audio_encoder import load_audio_encoder
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_asr.decoder import load_decoder
from omnistage.models.qwen3_asr.processor import ASRProcessor
from omnistage.outputs import RequestOutput
from omnistage.pipeline.base import Frontend, TtsPrompt
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni_encoders import aut_clips
from omnistage.pipeline.qwen3_omni_loading import eos_token_ids, thinker_settings
from omnistage.pipeline.samples import validate_text
from omnistage.pipeline.topology import validate_topology
from omnistage.request import GenerationRequest, ValidRequest

NO_SPEECH = "this model transcribes audio; it does not speak (a Qwen3-Omni checkpoint does)"
# Qwen3-ASR is served for many short clips at once: this many sequences (and decode graphs up to them) where the
# config sets none, against Qwen3-Omni's 64
ASR_MAX_NUM_SEQS = 128
# and a streamed transcript's output every few tokens: at c=128 each output a step costs the engine's thread and
# the event loop more than the GPU's decode step (benchmarks/RESULTS.md, "A streamed reply's outputs every few
# tokens")
ASR_STREAM_INTERVAL = 4


def asr_defaults(config: EngineConfig) -> EngineConfig:
    """`config` with Qwen3-ASR's own defaults where it leaves a setting to the default."""
    if config.stream_interval is None:
        config = config.model_copy(update={"stream_interval": ASR_STREAM_INTERVAL})
    if config.stages.thinker.max_batch is not None:
        return config
    return config.with_stage("thinker", max_batch=ASR_MAX_NUM_SEQS)


def asr_frontend(
    processor: ASRProcessor, model_path: Path, max_model_len: int, plan_gauges: tuple[Gauge, ...] = ()
) -> Frontend:
    """A Qwen3-ASR pipeline's Frontend: no voices, and a text to speak is refused."""
    return Frontend(model_path, max_model_len, processor, _speaks_not, (), plan_gauges)


def _speaks_not(text: str) -> TtsPrompt:
    raise InvalidRequest(NO_SPEECH)


class Qwen3ASRPipeline:
    """Qwen3-ASR's stages behind the Pipeline interface (base.py)."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.model is not None  # family.py picks this pipeline by the checkpoint's model type
        path = Path(config.model)
        config = asr_defaults(config)
        self.config, self.model_config = config, Qwen3ASRConfig.from_dir(path)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        validate_topology(config, gpus, stages=STAGES[:2])  # no speech stages
        device = resolve_device(config.stage("thinker").device)
        dtype = resolve_dtype(config.dtype, device)
        started = time.perf_counter()
        options = LoadOptions(dtype, device, config.load_format, config.seed)
        decoder = load_decoder(
            path, options, backend_for(device, config.flash_prefill, config.long_prefill_kernel)
        )
        tower = load_audio_encoder(path, options)
        processor = ASRProcessor(path)
        stage = StageModels(
            model=decoder,
            text=self.model_config.text,
            processor=processor,
            encoders=EncoderStage(
                tower,
                aut_clips(self.model_config.audio_token_id),
                device,
                cache_bytes=config.stage("encoders").cache_bytes,
            ),
            eos_token_ids=eos_token_ids(path, processor.tokenizer),
            model_path=path,
            load_seconds=time.perf_counter() - started,
        )
        # the released checkpoints call the encoder and decoder the thinker, as Qwen3-Omni's
        self.thinker = TextStage(thinker_settings(config), stage, device, dtype)
        needs = [(device, self.thinker.memory())] if device.type == "cuda" else []
        self.plans = plan_devices(needs, config.gpu_memory_limit_gib)
        if device in self.plans:
            self.thinker.allocate(self.plans[device])
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.model_path, self.max_model_len = path, self.thinker.context_tokens
        self.device, self.dtype = device, dtype
        gauges = tuple(gauge for plan in self.plans.values() for gauge in plan_gauges(plan))
        self.frontend = asr_frontend(processor, path, self.max_model_len, gauges)

    def memory_summary(self) -> str:
        return self.thinker.memory_summary() + "; Qwen3-ASR: transcription only"

    def validate(self, request: GenerationRequest) -> ValidRequest:
        """Check a request against the decoder stage, once: what admits it trusts the ValidRequest."""
        if request.speech is not None:
            raise InvalidRequest(NO_SPEECH)
        return validate_text(self.thinker, request)

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[Exception | None]:
        """Admit several requests, each validated once, here; per request, None or what kept it out."""
        errors: list[Exception | None] = [None] * len(requests)
        valid: dict[int, ValidRequest] = {}
        for i, r in enumerate(requests):
            try:
                valid[i] = self.validate(r)
            except Exception as exc:
                errors[i] = exc
        for i, error in zip(valid, self.thinker.add_requests([NewRequest.of(v) for v in valid.values()])):
            errors[i] = error
        return errors

    def step(self) -> list[RequestOutput]:
        return self.thinker.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.thinker.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.thinker.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.thinker.num_waiting

    def stats(self) -> dict[str, int]:
        return self.thinker.stats()
