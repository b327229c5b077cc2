"""The Qwen3-Omni audio encoder ("AuT"): log-mel frames to thinker-sized audio tokens at 12.5 Hz.

Each clip is cut into 1 s chunks (2 * n_window mel frames); three stride-2 convolutions turn a chunk into
13 tokens with sinusoidal positions restarting per chunk; transformer layers attend within windows of
n_window_infer frames (8 s, 104 tokens) of the same clip; ln_post and a two-layer MLP project to the
thinker's width. Many clips of different lengths go through one call as a ragged batch. The host-side layout
(audio_layout, audio_windows, gather_chunks; the tower's `windows`, `output_tokens` and `gather_chunks` at its
sizes) stays apart from the math (conv_embed, encode), which the engine's CUDA graphs also run over padded
windows.

Every chunk is zero-padded to the full chunk length before the convolutions. transformers pads to the
longest chunk of its batch instead, so a clip under 1 s encoded alone there differs from ours (through
the convolutions' edge and then attention, every token moves); beside any clip of 1 s or more it is
padded as ours. With ours a clip's tokens never depend on what it is batched with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.activations import ACTIVATIONS
from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.layers.varlen_attention import Segments, varlen_attention
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.config import AudioEncoderConfig, Qwen3OmniConfig

PREFIX = "thinker.audio_tower."


def _conv_out(frames: int) -> int:
    return (frames - 1) // 2 + 1


def audio_output_tokens(mel_frames: int, n_window: int = 50) -> int:
    """Audio tokens the encoder emits for a clip of `mel_frames` frames (the processor's placeholder count)."""
    chunk = 2 * n_window
    full, tail = divmod(mel_frames, chunk)
    tail_tokens = _conv_out(_conv_out(_conv_out(tail))) if tail else 0
    return full * _conv_out(_conv_out(_conv_out(chunk))) + tail_tokens


@dataclass(frozen=True)
class AudioLayout:
    """Host-side shape of one ragged batch: chunks, tokens and attention windows (plain numbers)."""

    frames: list[int]  # mel frames per clip
    chunk_frames: list[int]  # frames per chunk, every clip's chunks in order
    chunk_tokens: list[int]  # tokens per chunk
    tokens: list[int]  # tokens per clip
    cu_seqlens: list[int]  # attention window boundaries over the packed tokens


def audio_layout(frames: list[int], n_window: int, n_window_infer: int) -> AudioLayout:
    """Chunks of 2 * n_window frames, and windows of n_window_infer frames' worth of tokens, per clip."""
    chunk = 2 * n_window
    window_tokens = audio_output_tokens(chunk, n_window) * (n_window_infer // chunk)
    chunk_frames, cu_seqlens, tokens = [], [0], []
    for n in frames:
        if n <= 0:
            raise ValueError(f"an audio clip needs at least one mel frame, got {n}")
        full, tail = divmod(n, chunk)
        chunk_frames += [chunk] * full + ([tail] if tail else [])
        clip_tokens = audio_output_tokens(n, n_window)
        tokens.append(clip_tokens)
        whole, rest = divmod(clip_tokens, window_tokens)
        for size in [window_tokens] * whole + ([rest] if rest else []):
            cu_seqlens.append(cu_seqlens[-1] + size)
    chunk_tokens = [audio_output_tokens(c, n_window) for c in chunk_frames]
    return AudioLayout(list(frames), chunk_frames, chunk_tokens, tokens, cu_seqlens)


@dataclass(frozen=True)
class AudioWindow:
    """One attention window of a clip: n_window_infer frames (the clip's last may be shorter)."""

    start: int  # its first mel frame in the packed features
    frames: int
    tokens: int


def audio_windows(frames: list[int], n_window: int, n_window_infer: int) -> list[AudioWindow]:
    """The attention windows of packed clips, in order. Nothing crosses a window (its chunks are convolved
    alone and its tokens attend only within it), so any windows can be encoded together or apart."""
    windows, offset = [], 0
    for n in frames:
        for start in range(0, n, n_window_infer):
            size = min(n_window_infer, n - start)
            windows.append(AudioWindow(offset + start, size, audio_output_tokens(size, n_window)))
        offset += n
    return windows


def gather_chunks(packed: torch.Tensor, starts: list[int], lengths: list[int], chunk: int) -> torch.Tensor:
    """Chunks [n, mel, chunk] of packed features [mel, total]: `lengths[i]` frames from `starts[i]`, then
    zeros (a length of 0 gives an all-zero chunk)."""
    device = packed.device
    bounds = to_device(torch.tensor([starts, lengths]), device)
    index = bounds[0, :, None] + torch.arange(chunk, device=device)  # [n, chunk]
    valid = torch.arange(chunk, device=device) < bounds[1, :, None]
    chunks = packed.T[index.clamp(max=packed.shape[-1] - 1)] * valid[..., None]  # [n, chunk, mel]
    return chunks.transpose(1, 2)


def sinusoids(
    length: int, channels: int, max_timescale: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Whisper's sinusoidal positions [length, channels]: sines then cosines over log-spaced timescales."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32, device=device))
    angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_timescales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cu_seqlens: Segments | list[int]) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, -1)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        return self.out_proj(varlen_attention(q, k, v, cu_seqlens).reshape(x.shape[0], -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation_function]

    def forward(self, x: torch.Tensor, cu_seqlens: Segments | list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        if cfg.activation_function not in ACTIVATIONS:
            raise ValueError(f"audio activation_function {cfg.activation_function!r} is not supported")
        self.cfg = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        mel_out = _conv_out(_conv_out(_conv_out(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(c * mel_out, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation_function]
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    def layout(self, frames: list[int]) -> AudioLayout:
        return audio_layout(frames, self.cfg.n_window, self.cfg.n_window_infer)

    def windows(self, frames: list[int]) -> list[AudioWindow]:
        """The attention windows of packed clips of `frames` mel frames each (`audio_windows`)."""
        return audio_windows(frames, self.cfg.n_window, self.cfg.n_window_infer)

    def output_tokens(self, frames: int) -> int:
        """The tokens of `frames` mel frames: a clip's, a window's or a chunk's (`audio_output_tokens`)."""
        return audio_output_tokens(frames, self.cfg.n_window)

    def gather_chunks(self, packed: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
        """Zero-padded chunks of packed features at this tower's chunk size (`gather_chunks`)."""
        return gather_chunks(packed, starts, lengths, 2 * self.cfg.n_window)

    def forward(
        self, features: list[torch.Tensor] | torch.Tensor, lengths: list[int] | torch.Tensor | None = None
    ) -> list[torch.Tensor] | torch.Tensor:
        """Clips' features (a list of [mel, frames], or packed [mel, total] with `lengths`) to audio tokens.

        A list gives a list of [tokens_i, output_dim]; a packed input gives packed [sum tokens_i, output_dim].
        """
        packed_input = isinstance(features, torch.Tensor)
        if isinstance(features, torch.Tensor):
            if lengths is None:
                raise ValueError("packed audio features need their per-clip lengths")
            frames = [int(n) for n in lengths]
            packed = features
        else:
            frames = [f.shape[-1] for f in features]
            packed = torch.cat(list(features), dim=-1)
        if packed.shape[-1] != sum(frames):
            raise ValueError(f"audio features hold {packed.shape[-1]} frames, lengths say {sum(frames)}")
        layout = self.layout(frames)
        x = self.embed_chunks(packed, layout)
        x = self.encode(x, Segments.of(layout.cu_seqlens, x.device))
        return x if packed_input else list(x.split(layout.tokens))

    def embed_chunks(self, packed: torch.Tensor, layout: AudioLayout) -> torch.Tensor:
        """Packed features [mel, total] to packed chunk tokens [sum tokens, d_model], positions added."""
        starts = [0, *itertools.accumulate(layout.chunk_frames[:-1])]
        x = self.conv_embed(self.gather_chunks(packed, starts, layout.chunk_frames))
        per_chunk = x.shape[1]
        keep = [i * per_chunk + t for i, n in enumerate(layout.chunk_tokens) for t in range(n)]
        return x.flatten(0, 1).index_select(0, to_device(torch.tensor(keep), x.device))

    def conv_embed(self, chunks: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
        """Zero-padded chunks [n, mel, 2 * n_window] to tokens [n, tokens of a whole chunk, d_model], each
        chunk's positions added (a shorter chunk's tokens past its own are padding). The convolutions take
        `group_size` chunks at a time (default conv_chunksize): their activations are the peak."""
        chunks = chunks.unsqueeze(1).to(self.conv2d1.weight.dtype)
        embeds = []
        for group in chunks.split(group_size or self.cfg.conv_chunksize):
            h = F.gelu(self.conv2d1(group))
            h = F.gelu(self.conv2d2(h))
            h = F.gelu(self.conv2d3(h))
            n, c, f, t = h.shape
            embeds.append(self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f)))
        x = torch.cat(embeds)
        return x + sinusoids(x.shape[1], self.cfg.d_model, device=x.device).to(x.dtype)

    def encode(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Chunk tokens [tokens, d_model] through the layers (attention within `segments`) and the projector."""
        for layer in self.layers:
            x = layer(x, segments)
        return self.proj2(self.act(self.proj1(self.ln_post(x))))


def load_audio_encoder(checkpoint_dir: str | Path, options: LoadOptions) -> AudioEncoder:
    """The audio encoder of a Qwen3-Omni checkpoint directory, weights read by their file names."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).thinker.audio
    return load_model(lambda: AudioEncoder(cfg), checkpoint_dir, PREFIX, options)
