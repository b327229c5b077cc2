"""Qwen3-Omni's Thinker stage loaded from a checkpoint, its settings, its end tokens, and the Frontend its
pipeline hands the server."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer

from omnistage.config import EngineConfig
from omnistage.engine.attention import backend_for
from omnistage.engine.memory.gauges import Gauge
from omnistage.engine.stages.text_setup import StageModels, TextSettings
from omnistage.errors import CheckpointError
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.thinker import load_thinker
from omnistage.pipeline.base import Frontend, TtsPrompt
from omnistage.pipeline.qwen3_omni_encoders import load_encoders


def load_thinker_stage(
    config: EngineConfig,
    path: Path,
    cfg: Qwen3OmniConfig,
    processor: Processor,
    device: torch.device,
    dtype: torch.dtype,
) -> StageModels:
    """The Thinker's decoder and the audio and vision encoders, with `processor`, for a TextStage."""
    started = time.perf_counter()
    options = LoadOptions(dtype, device, config.load_format, config.seed)
    model = load_thinker(path, options, backend_for(device, config.flash_prefill, config.long_prefill_kernel))
    encoders = load_encoders(path, cfg.thinker, options, config.stage("encoders").cache_bytes)
    return StageModels(
        model=model,
        text=cfg.thinker.text,
        processor=processor,
        encoders=encoders,
        eos_token_ids=eos_token_ids(path, processor.tokenizer),
        model_path=path,
        load_seconds=time.perf_counter() - started,
    )


def thinker_settings(config: EngineConfig) -> TextSettings:
    """What the Thinker's TextStage reads of `config` (Qwen3-ASR's decoder's too): its section and its encoders',
    resolved, and the engine-wide settings."""
    return TextSettings(config.stage("thinker"), config.stage("encoders"), config.engine_settings())


def eos_token_ids(checkpoint_dir: Path, tokenizer: Tokenizer) -> list[int]:
    """The checkpoint's generation end tokens, else `<|im_end|>`."""
    path = checkpoint_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end is None:
        raise CheckpointError(
            f"{checkpoint_dir}: no generation_config.json eos_token_id, nor <|im_end|> to end on"
        )
    return [im_end]


def tts_prompt(processor: Processor, text: str, max_model_len: int) -> TtsPrompt:
    """The prompt and reply of speaking `text` exactly: the text as the user's turn, and as the reply."""
    prompt, token_ids = processor.encode_chat([{"role": "user", "content": text}], True, max_model_len)
    return TtsPrompt(prompt, token_ids, processor.encode(text, max_model_len))


def omni_frontend(
    processor: Processor,
    model_path: Path,
    max_model_len: int,
    voices: tuple[str, ...] = (),
    plan_gauges: tuple[Gauge, ...] = (),
) -> Frontend:
    """A Qwen3-Omni pipeline's Frontend: a text is spoken as the user's turn and as the reply (`tts_prompt`)."""
    speak = partial(tts_prompt, processor, max_model_len=max_model_len)
    return Frontend(model_path, max_model_len, processor, speak, voices, plan_gauges)
