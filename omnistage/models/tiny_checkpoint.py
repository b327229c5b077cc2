"""What every family's tiny checkpoint is made of: shrunken sizes, seeded random bf16 weights, the files.

A tiny checkpoint keeps the released config but for its sizes, the released tensor names and the real Qwen
vocabulary; its weights are random, seeded (the same seed writes the same bytes), and keep activations O(1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

# The sizes the families' tiny decoders and audio encoders (the same AuT) share.
DECODER_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
AUDIO_ENCODER_SIZES = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "downsample_hidden_size": 8,
    "output_dim": 64,
}


def whisper_mel(seconds: int) -> dict:
    """A preprocessor's Whisper-style 128-bin log-mel at 16 kHz over windows of `seconds`."""
    return {
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": seconds,
        "n_samples": 16000 * seconds,
        "nb_max_frames": 100 * seconds,
        "padding_side": "right",
        "padding_value": 0.0,
        "dither": 0.0,
        "return_attention_mask": True,
    }


def package_config(name: str) -> dict:
    """A released config.json shipped as package data (`omnistage/data/`)."""
    return json.loads((resources.files("omnistage") / "data" / name).read_text())


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers without its warnings and progress bars, while it lays out a tiny model."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
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


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random bf16 tensors of `shapes`, drawn in their order."""
    generator = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, shape, generator).to(torch.bfloat16) for name, shape in shapes.items()}


def write_json(directory: Path, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data, indent=2) + "\n")


def write_checkpoint(
    directory: str | Path, config: dict, tensors: dict[str, torch.Tensor] | None = None
) -> Path:
    """`directory` (made if missing) with config.json and, given `tensors`, model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_json(directory, "config.json", config)
    return directory
