"""The Talker: a Qwen3 MoE decoder that reads the Thinker's rows and speaks code 0 of each codec frame.

It consumes embeddings, never ids. Its prompt rows are Thinker rows mapped to its width:
`text_projection` of token embeddings, `hidden_projection` of the layer-`accept_hidden_layer` hidden
states at audio/image positions, plus `model.codec_embedding` of codec ids; `codec_head` scores the next
frame's code 0. Parameter names equal the checkpoint's minus `talker.`; `talker.code_predictor.*` belongs
to the code predictor (`code_predictor.py`), which reads the final hidden states this module returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.decoder import Decoder
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig, TalkerConfig, TextConfig
from omnistage.models.qwen3_omni.moe_decoder import moe_decoder_layer

if TYPE_CHECKING:
    from omnistage.models.layers.attention_backend import AttentionBackend
    from omnistage.models.layers.attention_metadata import AttentionMetadata

CODE_PREDICTOR_PREFIX = "talker.code_predictor."


class ResizeMLP(nn.Module):
    """linear_fc2(SiLU(linear_fc1(x))), with biases: a Thinker-width row to the Talker's width."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(Decoder):
    """The Talker's decoder: fed rows, with `codec_embedding` for the codec ids among them."""

    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, lambda: moe_decoder_layer(cfg, backend), cfg.mrope_section)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        width = cfg.text.hidden_size
        self.model = TalkerModel(cfg.text, backend)
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, cfg.projection_intermediate_size, width)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, cfg.projection_intermediate_size, width)
        self.codec_head = nn.Linear(width, cfg.text.vocab_size, bias=False)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-norm hidden states `[T, H]` of the flat batch `inputs_embeds` `[T, H]` at M-RoPE `positions` `[3, T]`.

        Decode rows take position cache length + rope delta on all three streams.
        """
        return cast(torch.Tensor, self.model(inputs_embeds, positions, kv_caches, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codec logits `[T, vocab]` (float32); code 0 of the next frame."""
        return self.codec_head(hidden).float()


def load_talker(checkpoint_dir: str | Path, options: LoadOptions, backend: AttentionBackend) -> Talker:
    """The Talker from a Qwen3-Omni checkpoint directory (every `talker.*` tensor but the code predictor's)."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).talker
    return load_model(
        lambda: Talker(cfg, backend),
        checkpoint_dir,
        "talker.",
        options,
        exclude=(CODE_PREDICTOR_PREFIX,),
    )
