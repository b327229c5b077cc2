"""Qwen3-ASR's audio encoder: the Qwen3-Omni AuT, smaller, and its projector.

The math is Qwen3-Omni's to the last op (1 s chunks through three stride-2 convolutions, sinusoidal positions
per chunk, attention in 8 s windows, ln_post, then proj1 -> GELU -> proj2 to the decoder's width), so the
module is `omnistage.models.qwen3_omni.audio_encoder.AudioEncoder`, built from this checkpoint's sizes.
Only the tensor names differ by layout: the released files keep the projector inside the tower
(`thinker.audio_tower.proj1/proj2`), transformers' -hf files beside it (`model.multi_modal_projector.linear_1/2`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder

RELEASED_PREFIX = "thinker.audio_tower."
HF_TOWER_PREFIX = "model.audio_tower."
HF_PROJECTOR_PREFIX = "model.multi_modal_projector."
PROJECTOR = {"proj1": "linear_1", "proj2": "linear_2"}


def _hf_views(encoder: AudioEncoder) -> list[tuple[nn.Module, str]]:
    """Containers that share the encoder's submodules under the -hf names, so loading stays a lookup."""
    tower, projector = nn.Module(), nn.Module()
    for name, child in encoder.named_children():
        if name in PROJECTOR:
            projector.add_module(PROJECTOR[name], child)
        else:
            tower.add_module(name, child)
    return [(tower, HF_TOWER_PREFIX), (projector, HF_PROJECTOR_PREFIX)]


def load_audio_encoder(checkpoint_dir: str | Path, options: LoadOptions) -> AudioEncoder:
    """The audio encoder and projector of a Qwen3-ASR checkpoint directory (either layout)."""
    cfg = Qwen3ASRConfig.from_dir(checkpoint_dir)
    by_name = cfg.layout == "released" or options.load_format == "dummy"
    return load_model(
        lambda: AudioEncoder(cfg.audio), checkpoint_dir, RELEASED_PREFIX if by_name else _hf_views, options
    )
