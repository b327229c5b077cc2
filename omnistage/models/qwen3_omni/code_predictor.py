"""The Talker's code predictor: a small dense decoder that fills in codes 1..G-1 of each audio frame.

The Talker predicts code 0 of a frame; the code predictor then runs a fresh G-position sequence per frame
(position 0: the Talker's final-norm hidden state, position 1: code 0's embedding, position g + 1: code g's
embedding) and reads code g + 1 through head g. Its K/V live in a small static per-frame cache, not in
pages: every row of a batch is at the same position at every inner step, so a batch of frames runs its
G - 1 steps together with fixed shapes and one Python loop of fixed length (one CUDA graph per batch size).

Parameter names equal the checkpoint's minus `talker.code_predictor.`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.errors import ConfigError
from omnistage.models.layers.attention import SelfAttention
from omnistage.models.layers.decoder import Decoder, DecoderLayer
from omnistage.models.layers.moe import GatedMLP
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.config import CodePredictorConfig, Qwen3OmniConfig

Sampler = Callable[[torch.Tensor], torch.Tensor]
"""Float32 logits `[B, vocab]` of one inner step -> ids `[B]`. Per-row settings live in the sampler (e.g. as
`[B]` tensors); it must not read device values on the host, so that a frame's steps can be captured."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class CodePredictorAttention(SelfAttention):
    """Qwen3 attention (per-head q/k RMSNorm, RoPE, GQA) over one layer's static per-frame cache."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        start: int,
        causal: bool,
    ) -> torch.Tensor:
        """x `[B, S, H]` at positions `start..start+S-1` (cos/sin `[S, head_dim]`); kv `[2, B, Hkv, G, D]`.
        `causal`: the S rows attend causally (the first step's, from position 0); else one row attends to all.
        A flag, not `S > 1`: under torch.compile a bool of a symbolic size breaks the graph at the attention."""
        q, k, v = self.heads(x, cos, sin)
        end = start + x.shape[1]
        kv[0, :, :, start:end] = k.transpose(1, 2)
        kv[1, :, :, start:end] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            kv[0, :, :, :end],
            kv[1, :, :, :end],
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return self.project_out(out.transpose(1, 2))


def code_predictor_layer(cfg: CodePredictorConfig) -> DecoderLayer:
    return DecoderLayer(cfg, CodePredictorAttention(cfg), GatedMLP(cfg.hidden_size, cfg.intermediate_size))


class CodePredictorModel(Decoder):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        # plain 1-D RoPE: one section holding every frequency, so all come from the first position stream
        super().__init__(cfg, lambda: code_predictor_layer(cfg), (cfg.head_dim // 2, 0, 0))
        # codec_embedding[g - 1] embeds code g (g = 1..G-1); code 0 is embedded by the Talker's own table
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = CodePredictorModel(cfg)
        # lm_head[g] reads code g + 1 from the hidden state at position g + 1
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )

    def new_kv(self, batch: int) -> torch.Tensor:
        """A per-frame cache `[layers, 2, batch, kv_heads, G, head_dim]`: G positions are the hidden state, code 0
        and codes 1..G-2 (the last code is read out, never fed back). Reusable across frames unzeroed: each
        step writes its position before any step reads it."""
        cfg = self.config
        weight = cast(nn.Linear, self.lm_head[0]).weight
        return torch.empty(
            cfg.num_hidden_layers,
            2,
            batch,
            cfg.num_key_value_heads,
            cfg.num_code_groups,
            cfg.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def predict_frame(
        self,
        talker_hidden: torch.Tensor,
        code0_embeds: torch.Tensor,
        sample: Sampler = greedy,
        kv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes 1..G-1 `[B, G-1]` of one frame per row, and the sum of its G code embeddings `[B, H]`.

        `talker_hidden` `[B, H]` is the Talker's final-norm hidden state that produced code 0;
        `code0_embeds` `[B, H]` is code 0 through the Talker's `codec_embedding`. The sum adds code 0's
        embedding (the Talker's table) to codes 1..G-1 through this model's `codec_embedding[0..G-2]`,
        as transformers forms the codec part of the Talker's next input (the caller adds the text part).
        `sample` picks each step's ids from its logits; `kv` (from `new_kv`) is overwritten.
        """
        groups = self.config.num_code_groups
        batch = talker_hidden.shape[0]
        kv = self.new_kv(batch) if kv is None else kv
        positions = torch.arange(groups, device=talker_hidden.device).expand(3, -1)
        cos, sin = self.model.rotary_emb(positions)
        codes = torch.empty(batch, groups - 1, dtype=torch.long, device=talker_hidden.device)
        embeds = torch.empty(
            batch, groups, talker_hidden.shape[1], dtype=code0_embeds.dtype, device=code0_embeds.device
        )
        embeds[:, 0] = code0_embeds
        x, start = torch.stack((talker_hidden, code0_embeds), dim=1), 0
        for step in range(groups - 1):
            end = start + x.shape[1]
            caches = [(layer_kv, start, step == 0) for layer_kv in kv]  # causal: the first step's rows
            hidden, _ = self.model.run(x, cos[start:end], sin[start:end], caches)
            ids = sample(self.lm_head[step](hidden[:, -1]).float())
            codes[:, step] = ids
            row = self.model.codec_embedding[step](ids)
            embeds[:, step + 1] = row
            # the row itself, not a view into `embeds`: every step's input then has one layout (compiled once)
            x, start = row[:, None], end
        # one reduction over the G embeddings, as transformers sums them (not G - 1 rounded additions)
        return codes, embeds.sum(dim=1)


def load_code_predictor(checkpoint_dir: str | Path, options: LoadOptions) -> CodePredictor:
    """The Talker's code predictor from a Qwen3-Omni checkpoint directory (`talker.code_predictor.*`)."""
    talker = Qwen3OmniConfig.from_dir(checkpoint_dir).talker
    cfg = talker.code_predictor
    # the Talker's hidden state and code-0 embedding enter the predictor as they are: no projection between
    if cfg.hidden_size != talker.text.hidden_size:
        raise ConfigError(
            f"talker_config.code_predictor_config.hidden_size: {cfg.hidden_size} differs from the talker's "
            f"hidden_size {talker.text.hidden_size}"
        )
    if cfg.num_code_groups != talker.num_code_groups:
        raise ConfigError(
            f"talker_config.code_predictor_config.num_code_groups: {cfg.num_code_groups} differs from the "
            f"talker's {talker.num_code_groups}"
        )
    return load_model(lambda: CodePredictor(cfg), checkpoint_dir, "talker.code_predictor.", options)
