"""Tiny random-weight Qwen3-ASR checkpoints, in the released layout or in transformers' -hf layout.

Sizes shrink, everything else stays: the released token ids and languages, the real Qwen vocabulary, the
tensor names each layout's files use, bf16 on disk. The same seed gives both layouts the same values, so a
checkpoint in one layout and its twin in the other are the same model.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from omnistage.models import tiny_checkpoint as tiny
from omnistage.models.qwen3_asr.config import EOS_TOKEN_IDS
from omnistage.models.qwen3_asr.tokenizer import write_tokenizer_files

RELEASED_CONFIG = "qwen3_asr_1p7b.config.json"

# The released preprocessor: Whisper's 128-bin log-mel at 16 kHz (qwen-asr calls it without truncation).
PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "processor_class": "Qwen3ASRProcessor",
    **tiny.whisper_mel(30),
}
# transformers' extractor for the -hf layout: the same mel, zero-padded to 0.5 s and to whole 1 s chunks.
HF_PREPROCESSOR_CONFIG = {
    **{
        k: v
        for k, v in PREPROCESSOR_CONFIG.items()
        if k not in ("n_samples", "nb_max_frames", "padding_side")
    },
    "feature_extractor_type": "Qwen3ASRFeatureExtractor",
    "n_window": 50,
    "min_length": 8000,
}
GENERATION_CONFIG = {
    "do_sample": False,
    "eos_token_id": list(EOS_TOKEN_IDS),
    "pad_token_id": 151645,
    "max_new_tokens": 512,
}

Layout = Literal["released", "hf"]


def released_config(name: str = RELEASED_CONFIG) -> dict:
    """A released Qwen3-ASR config.json (the nested layout), shipped as package data."""
    return tiny.package_config(name)


def tiny_config() -> dict:
    """The released 1.7B config with every size shrunk; ids, languages and rope settings kept."""
    c = copy.deepcopy(released_config())
    thinker = c["thinker_config"]
    thinker["text_config"].update(tiny.DECODER_SIZES, intermediate_size=96)
    thinker["text_config"]["rope_scaling"]["mrope_section"] = [4, 2, 2]
    thinker["audio_config"].update(tiny.AUDIO_ENCODER_SIZES)
    return c


def hf_config(released: dict) -> dict:
    """The same model in transformers' -hf layout: flattened, plain RoPE, the encoder's position table sized to
    one chunk, the languages dropped (as transformers' conversion writes it)."""
    thinker = released["thinker_config"]
    audio = {
        k: v
        for k, v in thinker["audio_config"].items()
        if k not in ("conv_chunksize", "max_source_positions")
    }
    audio.update(model_type="qwen3_asr_encoder", max_position_embeddings=13)
    text = {k: v for k, v in thinker["text_config"].items() if k not in ("rope_scaling", "rope_theta")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": thinker["text_config"]["rope_theta"]}
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "audio_config": audio,
        "text_config": text,
        "audio_token_id": thinker["audio_token_id"],
        "eos_token_id": list(EOS_TOKEN_IDS),
        "pad_token_id": 151645,
        "tie_word_embeddings": released.get("tie_word_embeddings", True),
    }


def released_name(hf_name: str) -> str:
    """A -hf tensor name as the released files spell it."""
    for hf, released in (
        ("model.multi_modal_projector.linear_1.", "thinker.audio_tower.proj1."),
        ("model.multi_modal_projector.linear_2.", "thinker.audio_tower.proj2."),
        ("model.language_model.", "thinker.model."),
        ("model.audio_tower.", "thinker.audio_tower."),
        ("lm_head.", "thinker.lm_head."),
    ):
        if hf_name.startswith(hf):
            return released + hf_name[len(hf) :]
    raise ValueError(f"{hf_name}: not a Qwen3-ASR tensor name")


def hf_layout(config: dict) -> tuple[dict[str, tuple[int, ...]], dict]:
    """Tensor names and shapes, and config.json, as transformers writes a model of `config` (-hf layout)."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    with tiny.quiet_transformers(), torch.device("meta"):
        model = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(**copy.deepcopy(config)))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    written = json.loads(model.config.to_json_string())
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return dict(sorted(shapes.items())), written


def make_tiny(directory: str | Path, seed: int = 0, layout: Layout = "released") -> Path:
    """Write a tiny random Qwen3-ASR checkpoint to `directory`; the same seed writes the same values."""
    released = tiny_config()
    shapes, hf_written = hf_layout(hf_config(released))
    tensors = tiny.random_weights(shapes, seed)
    if layout == "released":
        tensors = {released_name(name): t for name, t in tensors.items()}
        if released["tie_word_embeddings"]:
            # the released files carry the tied head as its own tensor, equal to the embedding table
            tensors["thinker.lm_head.weight"] = tensors["thinker.model.embed_tokens.weight"].clone()
    directory = tiny.write_checkpoint(directory, released if layout == "released" else hf_written, tensors)
    _write_processing(directory, layout)
    return directory


def released_skeleton(directory: str | Path, name: str = RELEASED_CONFIG) -> Path:
    """A checkpoint directory of a released config with no weights, for `load_format="dummy"` (benchmarks)."""
    directory = tiny.write_checkpoint(directory, released_config(name))
    _write_processing(directory, "released")
    return directory


def _write_processing(directory: Path, layout: Layout) -> None:
    """What a checkpoint of `layout` holds beside the model: generation, preprocessor and tokenizer files."""
    tiny.write_json(directory, "generation_config.json", GENERATION_CONFIG)
    preprocessor = PREPROCESSOR_CONFIG if layout == "released" else HF_PREPROCESSOR_CONFIG
    tiny.write_json(directory, "preprocessor_config.json", preprocessor)
    write_tokenizer_files(directory, hf_layout=layout == "hf")


def tensor_names(directory: str | Path) -> list[str]:
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return sorted(f.keys())
