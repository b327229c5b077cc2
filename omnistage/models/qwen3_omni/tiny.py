"""Tiny random-weight Qwen3-Omni checkpoints laid out exactly like the released one.

Sizes shrink, everything else stays: the released token ids, speakers and codec ids, the real Qwen
vocabulary, tensor names as the released files spell them (one tensor per expert), bf16 on disk.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from omnistage.models import tiny_checkpoint as tiny
from omnistage.models.qwen3_omni.chat_templates import VARIANTS, chat_template
from omnistage.models.qwen3_omni.tokenizer import write_tokenizer_files
from omnistage.models.qwen3_omni.video_processing import VIDEO_CONFIG, released_video_config

RELEASED_CONFIG = "qwen3_omni_30b_a3b_instruct.config.json"

# Mel and image settings of the released preprocessor (Whisper-style 128-bin log-mel; Qwen2-VL resizing).
PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    **tiny.whisper_mel(300),
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
# The Talker's width, which its code predictor shares (it reads the Talker's hidden states as they are).
TALKER_WIDTH = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def released_config() -> dict:
    """The released Qwen3-Omni-30B-A3B-Instruct config.json, shipped as package data."""
    return tiny.package_config(RELEASED_CONFIG)


def tiny_config() -> dict:
    """The released config with every size shrunk; ids, speakers and rope layout kept."""
    c = copy.deepcopy(released_config())
    thinker, talker = c["thinker_config"], c["talker_config"]
    thinker["text_config"].update(
        tiny.DECODER_SIZES,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    thinker["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
    thinker["audio_config"].update(tiny.AUDIO_ENCODER_SIZES)
    thinker["vision_config"].update(
        hidden_size=32,
        depth=4,
        deepstack_visual_indexes=[1, 2, 3],
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
    )
    talker["text_config"].update(
        TALKER_WIDTH,
        num_hidden_layers=2,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
    )
    talker["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
    talker["code_predictor_config"].update(
        TALKER_WIDTH,
        num_hidden_layers=1,
        intermediate_size=64,
        layer_types=["full_attention"],
    )
    talker.update(thinker_hidden_size=64, accept_hidden_layer=1)
    c["code2wav_config"].update(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        decoder_dim=32,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
    )
    return c


def checkpoint_layout(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint for `config`, as transformers writes it to disk."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    with tiny.quiet_transformers(), torch.device("cpu"), tempfile.TemporaryDirectory() as tmp:
        model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**config))
        model.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in sorted(f.keys())}


def write_weights(directory: str | Path, config: dict, seed: int) -> Path:
    """`config.json` and seeded random bf16 weights for every tensor `config` lays out, in `directory`."""
    return tiny.write_checkpoint(directory, config, tiny.random_weights(checkpoint_layout(config), seed))


def variant_config(variant: str = "instruct") -> dict:
    """The tiny config of a released variant. The Thinking and Captioner checkpoints are the Thinker alone:
    `enable_audio_output` false, which is also what keeps transformers from building (and us from loading or
    planning) a Talker and Code2Wav, so their checkpoints hold no `talker.*` or `code2wav.*` tensors."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen3-Omni variant {variant!r}; one of {', '.join(VARIANTS)}")
    config = tiny_config()
    if variant != "instruct":
        config["enable_audio_output"] = False
    return config


def make_tiny(directory: str | Path, seed: int = 0, variant: str = "instruct") -> Path:
    """Write a tiny random Qwen3-Omni checkpoint of `variant` (instruct, thinking, captioner) to `directory`;
    the same seed writes the same bytes."""
    directory = write_weights(directory, variant_config(variant), seed)
    generation = {"do_sample": False, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    tiny.write_json(directory, "generation_config.json", generation)
    tiny.write_json(directory, "preprocessor_config.json", PREPROCESSOR_CONFIG)
    tiny.write_json(directory, VIDEO_CONFIG, released_video_config())
    write_tokenizer_files(directory, chat_template(variant))
    return directory


def cache_dir() -> Path:
    """Where omnistage keeps what it makes for itself: $OMNISTAGE_CACHE, else ~/.cache/omnistage."""
    root = os.environ.get("OMNISTAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "omnistage"
    )
    return Path(root)


# Bump when the tiny layout or its values change, so stale caches are not served.
TINY_VERSION = 2


def default_checkpoint() -> Path:
    """The embedded default model: a tiny random Qwen3-Omni checkpoint, made on first use and cached."""
    target = cache_dir() / f"tiny-qwen3-omni-v{TINY_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash or a concurrent start never leaves half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    make_tiny(staging)
    try:
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").exists():
            raise
    return target
