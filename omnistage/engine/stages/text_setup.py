"""What a family's pipeline builds a text stage from: the settings it reads of the config, the models it loads
(pipeline/qwen3_omni_loading.py, pipeline/qwen3_asr.py), and the requests it hands the stage (`NewRequest`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from omnistage.config import DecoderSettings, EncodersSettings, EngineSettings
from omnistage.engine.stages.decoder import DecoderSizes, StageProcessor, TokenDecoder
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.token_runner import HiddenTap
from omnistage.request import GenerationRequest, ValidRequest


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


@dataclass(frozen=True)
class NewRequest(GenerationRequest):
    """A request as the stage takes it: the caller's (speech is the pipeline's business), and what the pipeline
    adds for a later stage."""

    tap: HiddenTap | None = None  # hidden states of prompt rows that a later stage reads
    # the effective max_tokens its pipeline's `validate` worked out (`of`): the stage checks nothing again;
    # None: a request handed to the stage directly, which the stage validates itself
    max_tokens: int | None = None

    @classmethod
    def of(cls, valid: ValidRequest, tap: HiddenTap | None = None) -> NewRequest:
        r = valid.request  # a GenerationRequest's fields, whichever subclass carried it
        given = {f.name: vars(r)[f.name] for f in fields(GenerationRequest)}
        return cls(**given, tap=tap, max_tokens=valid.max_tokens)
