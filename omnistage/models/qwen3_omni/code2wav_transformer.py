"""Code2Wav's pre-transformer: causal sliding-window attention over codec frames, run over a whole stream at
once or over its next chunk of frames.

Layer l's output at frame t reads layer l's keys and values of frames t − W + 1 .. t and nothing earlier (W:
`sliding_window`). So a chunk needs, of the stream's past, each layer's keys and values of the W − 1 frames
before it (`KeyValues`): given those, the chunk's output is the whole stream's (to float reduction order) for
the work of the chunk's own frames. Positions are frame indices in the stream; keys before frame 0 (the time
before the stream began) are masked, whatever they hold.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.moe import GatedMLP
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding, apply_rotary
from omnistage.models.qwen3_omni.config import Code2WavConfig


class KeyValues(NamedTuple):
    """Every layer's keys (rotated at their positions) and values: `[layers, B, kv_heads, frames, head_dim]`."""

    keys: torch.Tensor
    values: torch.Tensor


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Code2WavAttention(nn.Module):
    """Multi-head (or grouped) attention with RoPE and no q/k norm; the mask carries the sliding window."""

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x` `[B, n, H]` → (output `[B, n, H]`, keys, values `[B, kv_heads, P + n, head_dim]`): the `past`
        keys and values of P earlier frames, then the chunk's own."""
        batch, frames, _ = x.shape

        def heads(proj: nn.Linear, count: int) -> torch.Tensor:
            return proj(x).reshape(batch * frames, count, self.head_dim)

        q = apply_rotary(heads(self.q_proj, self.num_heads), cos, sin)
        k = apply_rotary(heads(self.k_proj, self.num_kv_heads), cos, sin)
        v = heads(self.v_proj, self.num_kv_heads)
        q, k, v = (t.reshape(batch, frames, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, frames, -1)), k, v


class Code2WavTransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Code2WavAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attended, keys, values = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.self_attn_layer_scale(attended)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x))), keys, values


class Code2WavTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.layers = nn.ModuleList(Code2WavTransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        # plain 1-D RoPE: every frequency from the first position stream
        self.rotary_emb = MRotaryEmbedding(head_dim, cfg.rope_theta, (head_dim // 2, 0, 0))

    def forward(
        self, hidden: torch.Tensor, start: torch.Tensor, past: KeyValues | None = None
    ) -> tuple[torch.Tensor, KeyValues]:
        """`hidden` `[B, n, H]`: row b's frames [start[b], start[b] + n) of its stream, after the P frames of
        `past` (`[layers, B, kv_heads, P, head_dim]`, P = W − 1 when given) → (output `[B, n, H]`, the keys and
        values of the last W − 1 frames of past and chunk, to pass as the next chunk's `past`)."""
        frames = hidden.shape[1]
        held = 0 if past is None else past.keys.shape[-2]
        positions = start[:, None] + torch.arange(frames, device=hidden.device)
        query = positions[:, :, None]
        key = (start[:, None] + torch.arange(-held, frames, device=hidden.device))[:, None, :]
        mask = ((key <= query) & (key > query - self.sliding_window) & (key >= 0))[:, None]
        cos, sin = self.rotary_emb(positions.reshape(1, -1).expand(3, -1))
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            hidden, k, v = layer(
                hidden, cos, sin, mask, None if past is None else (past.keys[i], past.values[i])
            )
            kept = k.shape[2] - (self.sliding_window - 1)
            keys.append(k[:, :, kept:])
            values.append(v[:, :, kept:])
        return self.norm(hidden), KeyValues(torch.stack(keys), torch.stack(values))
