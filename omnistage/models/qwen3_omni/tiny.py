"""Tiny random-weight Qwen3-Omni checkpoints laid out exactly like the released one.

Sizes shrink, everything else stays: the released token ids, speakers and codec ids, the real Qwen
vocabulary, tensor names as the released files spell them (one tensor per expert), bf16 on disk.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.models.qwen3_omni.tokenizer import write_tokenizer_files
from omnistage.models.qwen3_omni.video_processing import VIDEO_CONFIG, VIDEO_PREPROCESSOR_CONFIG

RELEASED_CONFIG = "qwen3_omni_30b_a3b_instruct.config.json"

# Mel and image settings of the released preprocessor (Whisper-style 128-bin log-mel; Qwen2-VL resizing).
PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "dither": 0.0,
    "return_attention_mask": True,
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


def released_config() -> dict:
    """The released Qwen3-Omni-30B-A3B-Instruct config.json, shipped as package data."""
    return json.loads((resources.files("omnistage") / "data" / RELEASED_CONFIG).read_text())


def tiny_config() -> dict:
    """The released config with every size shrunk; ids, speakers and rope layout kept."""
    c = copy.deepcopy(released_config())
    thinker, talker = c["thinker_config"], c["talker_config"]
    thinker["text_config"].update(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    thinker["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
    thinker["audio_config"].update(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        downsample_hidden_size=8,
        output_dim=64,
    )
    thinker["vision_config"].update(
        hidden_size=32,
        depth=4,
        deepstack_visual_indexes=[1, 2, 3],
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
    )
    talker["text_config"].update(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
    )
    talker["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
    talker["code_predictor_config"].update(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
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
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with torch.device("cpu"):
            model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**config))
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
                return {name: tuple(f.get_slice(name).get_shape()) for name in sorted(f.keys())}
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Values that keep activations O(1) through any depth: gains near 1, small biases, 1/sqrt(fan_in) weights."""
    noise = torch.randn(shape, generator=generator)
    if len(shape) == 1:
        return 1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    return noise / fan_in**0.5


def write_weights(directory: str | Path, config: dict, seed: int) -> Path:
    """`config.json` and seeded random bf16 weights for every tensor `config` lays out, in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: random_tensor(name, shape, generator).to(torch.bfloat16)
        for name, shape in checkpoint_layout(config).items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def make_tiny(directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen3-Omni checkpoint to `directory`; the same seed writes the same bytes."""
    directory = write_weights(directory, tiny_config(), seed)
    generation = {"do_sample": False, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    (directory / VIDEO_CONFIG).write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    write_tokenizer_files(directory)
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
