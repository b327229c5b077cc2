"""The Thinker's language model: a Qwen3 MoE decoder over a flat, ragged batch with paged KV.

Parameter names equal the checkpoint's minus `thinker.` (experts stacked, see `models/loader.py`).
Audio and vision towers live in their own modules; their features arrive as `inputs_embeds` and, for
vision, as `deepstack_embeds`.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.decoder import CausalLM, TextDecoder
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig, TextConfig
from omnistage.models.qwen3_omni.moe_decoder import moe_decoder_layer


class Thinker(CausalLM):
    config: TextConfig

    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, TextDecoder(cfg, lambda: moe_decoder_layer(cfg, backend), cfg.mrope_section))


def load_thinker(checkpoint_dir: str | Path, options: LoadOptions, backend: AttentionBackend) -> Thinker:
    """The Thinker's language model from a Qwen3-Omni checkpoint directory (`thinker.model.*`, `thinker.lm_head.*`)."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).thinker.text
    return load_model(
        lambda: Thinker(cfg, backend),
        checkpoint_dir,
        # two prefixes, because `thinker.` also holds the audio and vision towers
        lambda thinker: ((thinker.model, "thinker.model."), (thinker.lm_head, "thinker.lm_head.")),
        options,
    )
