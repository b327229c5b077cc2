"""Which pipeline serves a checkpoint: its config.json's model_type says the family."""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.config import EngineConfig
from omnistage.engine.compile_watch import starting_up
from omnistage.engine.memory.gauges import Gauge
from omnistage.models.qwen3_asr.processor import ASRProcessor
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.base import Frontend
from omnistage.pipeline.qwen3_asr import Qwen3ASRPipeline, asr_frontend
from omnistage.pipeline.qwen3_omni import Qwen3OmniPipeline
from omnistage.pipeline.qwen3_omni_loading import omni_frontend


def model_type(checkpoint_dir: str | Path) -> str | None:
    """config.json's model_type, or None where there is no readable one (the family's loader then says why)."""
    try:
        return json.loads((Path(checkpoint_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def processor_for(checkpoint_dir: str | Path) -> Processor | ASRProcessor:
    """The processor of a checkpoint's family (the server's process builds its own beside an engine process)."""
    return (
        ASRProcessor(checkpoint_dir)
        if model_type(checkpoint_dir) == "qwen3_asr"
        else Processor(checkpoint_dir)
    )


def frontend_for(
    checkpoint_dir: Path, max_model_len: int, voices: tuple[str, ...], plan_gauges: tuple[Gauge, ...]
) -> Frontend:
    """The Frontend of a checkpoint's pipeline running in another process (engine_process.py), around a
    processor of this process's own."""
    processor = processor_for(checkpoint_dir)
    if isinstance(processor, ASRProcessor):
        return asr_frontend(processor, checkpoint_dir, max_model_len, plan_gauges)
    return omni_frontend(processor, checkpoint_dir, max_model_len, voices, plan_gauges)


def build_pipeline(config: EngineConfig) -> Qwen3OmniPipeline | Qwen3ASRPipeline:
    """A Qwen3-ASR checkpoint's pipeline, or Qwen3-Omni's (the embedded tiny model's too). Its warm-up's and
    capture's builds are start-up's, also in a process that already serves (compile_watch.py)."""
    with starting_up():
        if config.model is not None and model_type(config.model) == "qwen3_asr":
            return Qwen3ASRPipeline(config)
        return Qwen3OmniPipeline(config)
