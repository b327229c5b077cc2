"""What a family's pipeline builds a text stage from: the settings it reads of the config, and the models it
loads (pipeline/qwen3_omni_loading.py, pipeline/qwen3_asr.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omnistage.config import DecoderSettings, EncodersSettings, EngineSettings
from omnistage.engine.stages.decoder import DecoderSizes, StageProcessor, TokenDecoder
from omnistage.engine.stages.encoders import EncoderStage


@dataclass(frozen=True)
class TextSettings:
    """What a text stage reads of the config, built by its pipeline: its own section and its encoders', every
    default resolved (`EngineConfig.stage`), and the engine-wide settings (`EngineConfig.engine_settings`)."""

    stage: DecoderSettings
    encoders: EncodersSettings
    engine: EngineSettings


@dataclass
class StageModels:
    """What a family's pipeline loads for a text stage (see pipeline/qwen3_omni.py): the decoder, its sizes,
    the processor that lays out its prompts, the encoders that fill their placeholders, and its end tokens."""

    model: TokenDecoder
    text: DecoderSizes
    processor: StageProcessor
    encoders: EncoderStage
    eos_token_ids: list[int]
    model_path: Path
    load_seconds: float
    # the layer whose hidden states a later stage reads from prompt rows (the Talker's accept_hidden_layer), if
    # one does: the prefill graphs record it too, so that a prompt with media a reply is spoken for replays them
    tap_layer: int | None = None
    name: str = "Thinker"  # the stage's name in its device's memory plan
