"""Tiny random-weight Qwen3-ASR checkpoints, in the released layout or in transformers' -hf layout.

Sizes shrink, everything else stays: the released token ids and languages, the real Qwen vocabulary, the
tensor names each layout's files use, bf16 on disk. The same seed gives both layouts the same values, so a
checkpoint in one layout and its twin in the other are the same model.
"""

from __future__ import annotations

import copy
import json
import os
from importlib import resources
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.models.qwen3_asr.config import EOS_TOKEN_IDS
from omnistage.models.qwen3_asr.tokenizer import write_tokenizer_files
from omnistage.models.qwen3_omni.tiny import random_tensor

RELEASED_CONFIG = "qwen3_asr_1p7b.config.json"

# The released preprocessor: Whisper's 128-bin log-mel at 16 kHz (qwen-asr calls it without truncation).
PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "processor_class": "Qwen3ASRProcessor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 30,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "dither": 0.0,
    "return_attention_mask": True,
}
# transformers' extractor for the -hf layout: the same mel, zero-padded to 0.5 s and to whole 1 s chunks.
HF_PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "Qwen3ASRFeatureExtractor",
    "processor_class": "Qwen3ASRProcessor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 30,
    "padding_value": 0.0,
    "dither": 0.0,
    "return_attention_mask": True,
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
    return json.loads((resources.files("omnistage") / "data" / name).read_text())


def tiny_config() -> dict:
    """The released 1.7B config with every size shrunk; ids, languages and rope settings kept."""
    c = copy.deepcopy(released_config())
    thinker = c["thinker_config"]
    thinker["text_config"].update(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    thinker["text_config"]["rope_scaling"]["mrope_section"] = [4, 2, 2]
    thinker["audio_config"].update(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        downsample_hidden_size=8,
        output_dim=64,
    )
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
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with torch.device("meta"):
            model = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(**copy.deepcopy(config)))
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        written = json.loads(model.config.to_json_string())
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return dict(sorted(shapes.items())), written


def make_tiny(directory: str | Path, seed: int = 0, layout: Layout = "released") -> Path:
    """Write a tiny random Qwen3-ASR checkpoint to `directory`; the same seed writes the same values."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    released = tiny_config()
    shapes, hf_written = hf_layout(hf_config(released))
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: random_tensor(name, shape, generator).to(torch.bfloat16) for name, shape in shapes.items()
    }
    if layout == "released":
        tensors = {released_name(name): t for name, t in tensors.items()}
        if released["tie_word_embeddings"]:
            # the released files carry the tied head as its own tensor, equal to the embedding table
            tensors["thinker.lm_head.weight"] = tensors["thinker.model.embed_tokens.weight"].clone()
        config = released
    else:
        config = hf_written
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    preprocessor = PREPROCESSOR_CONFIG if layout == "released" else HF_PREPROCESSOR_CONFIG
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    write_tokenizer_files(directory, hf_layout=layout == "hf")
    return directory


def released_skeleton(directory: str | Path, name: str = RELEASED_CONFIG) -> Path:
    """A checkpoint directory of a released config with no weights, for `load_format="dummy"` (benchmarks)."""
    directory = Path(directory)
    (directory / "config.json").write_text(json.dumps(released_config(name), indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    write_tokenizer_files(directory, hf_layout=False)
    return directory


def tensor_names(directory: str | Path) -> list[str]:
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return sorted(f.keys())
