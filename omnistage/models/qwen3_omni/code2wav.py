"""Code2Wav: codec frames to a 24 kHz waveform, in one shot or streamed chunk by chunk.

codes `[B, num_quantizers, T]` → the mean of the quantizers' embeddings → a causal sliding-window
transformer → two transposed-conv upsamplers, each followed by a ConvNeXt block → a causal conv decoder
(blocks of SnakeBeta, transposed conv and dilated residual units) → samples clamped to ±1. Parameter
names equal the checkpoint's minus `code2wav.`.

Every layer is causal except the decoder's transposed convolutions, which read one input sample ahead.
So a prefix of the frames decodes to a prefix of the waveform, T frames give `samples_per_frame · T −
lookahead` samples, and the last `lookahead` samples of any prefix wait for the next frame. The streamer
uses exactly this: a chunk of frames [a, b) emits samples [spf·a − lookahead, spf·b − lookahead). Of the
stream's past, a chunk reads each transformer layer's keys and values of the last W − 1 frames
(`code2wav_transformer.py`) and each convolution's last input samples (`code2wav_vocoder.py`), which its
stream's slot carries from the chunk before (`StreamSlots`, `Code2Wav.decode_chunk`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav_transformer import Code2WavTransformer, KeyValues
from omnistage.models.qwen3_omni.code2wav_vocoder import (
    CONV_KERNEL,
    Carry,
    CausalConv1d,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
    TrimmedConvTranspose1d,
)
from omnistage.models.qwen3_omni.config import Code2WavConfig, Qwen3OmniConfig


def lookahead_samples(cfg: Code2WavConfig) -> int:
    """Samples at the end of a decode that the next frame would still change (and a decode leaves out).

    A decoder block's transposed conv (kernel 2s, stride s, s trimmed from each end) turns L samples into
    s·(L − 1): each block drops one input sample's worth at its output rate, compounding through the later
    blocks (released: ((8·5 + 5)·4 + 4)·3 + 3 = 555).
    """
    lost = 0
    for rate in cfg.upsample_rates:
        lost = (lost + 1) * rate
    return lost


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, hidden)
        self.pre_transformer = Code2WavTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([TrimmedConvTranspose1d(hidden, hidden, ratio, ratio), ConvNeXtBlock(hidden)])
            for ratio in cfg.upsampling_ratios
        )
        decoder: list[nn.Module] = [CausalConv1d(hidden, cfg.decoder_dim, CONV_KERNEL)]
        lag = 0  # samples a block's output lags a chunk's, streamed (`code2wav_vocoder`)
        for i, rate in enumerate(cfg.upsample_rates):
            lag = (lag + 1) * rate
            decoder.append(DecoderBlock(cfg.decoder_dim // 2**i, rate, lag))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        decoder += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, CONV_KERNEL, lag)]
        self.decoder = nn.ModuleList(decoder)
        self.lookahead = lookahead_samples(cfg)
        # the modules that read across a chunk's start, in a fixed order (`StreamSlots.tails`)
        self.carried = [
            m for m in self.modules() if isinstance(m, CausalConv1d | TrimmedConvTranspose1d) and m.carried[1]
        ]

    def num_samples(self, frames: int) -> int:
        return max(0, self.config.samples_per_frame * frames - self.lookahead)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """`[B, num_quantizers, T]` codes → `[B, T, H]`: quantizer q's codes index rows q·codebook_size + code of
        one shared table, and the quantizers' embeddings are averaged."""
        offsets = torch.arange(codes.shape[1], device=codes.device)[:, None] * self.config.codebook_size
        return self.code_embedding(codes + offsets).mean(1)

    def vocode(self, hidden: torch.Tensor, carry: Carry | None = None) -> torch.Tensor:
        """Transformer output `[B, T, H]` → waveform `[B, spf·T − lookahead]`; given a `Carry`, the next T frames
        of streams: `[B, spf·T]`, lagging the frames by `lookahead` samples."""
        x = hidden.transpose(1, 2)
        # each entry is a ModuleList of (upsampler, ConvNeXt block): nn.ModuleList is not generic
        for upsampler, convnext in cast("Iterable[nn.ModuleList]", self.upsample):
            x = convnext(upsampler(x), carry)
        first, *blocks, act, last = self.decoder
        x = first(x, carry=carry)
        for block in blocks:
            x = block(x, carry)
        return last(x, act, carry)[:, 0].clamp(-1, 1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot decode: codes `[B, num_quantizers, T]` → waveform `[B, spf·T − lookahead]`."""
        start = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        return self.vocode(self.pre_transformer(self.embed(codes), start)[0])

    def decode_chunk(
        self, codes: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, state: StreamSlots
    ) -> torch.Tensor:
        """The one-shot samples of each stream's next n frames, its past carried in `state`: `[B, spf·n]`.

        Row b holds frames [a, a + n) of a stream (`codes` `[B, num_quantizers, n]`, a = start[b]), whose state
        is in slot slots[b]: what its frames before a left there (anything when a = 0: it is not read), and,
        after the call, what these frames leave. Row b's samples are the stream's one-shot samples [spf·a −
        lookahead, spf·(a + n) − lookahead); positions before sample 0 hold garbage. Rows share no slot but the
        scratch one. Shapes depend only on (B, n), for CUDA graphs.
        """
        past = KeyValues(state.keys[:, slots], state.values[:, slots])
        hidden, kept = self.pre_transformer(self.embed(codes), start, past)
        carry = Carry({m: t[slots] for m, t in zip(self.carried, state.tails, strict=True)}, start == 0)
        wav = self.vocode(hidden, carry)
        state.keys.index_copy_(1, slots, kept.keys)
        state.values.index_copy_(1, slots, kept.values)
        for module, tail in zip(self.carried, state.tails, strict=True):
            tail.index_copy_(0, slots, carry.left[module])
        return wav


@dataclass(frozen=True)
class StreamSlots:
    """What each stream's chunks leave for its next, in a slot per stream: every transformer layer's keys and
    values of its last W − 1 frames, and each convolution's input samples that the next chunk's reads back
    (`code2wav_vocoder.Carry`; released: 2.6 MB a slot in bf16). The last slot is scratch, written by padding
    rows."""

    keys: torch.Tensor  # [layers, slots + 1, kv_heads, W − 1, head_dim]
    values: torch.Tensor
    tails: tuple[torch.Tensor, ...]  # per module of `Code2Wav.carried`: [slots + 1, C, k]

    @classmethod
    def allocate(cls, model: Code2Wav, slots: int) -> StreamSlots:
        """Zeros on the model's device: a masked key's value still enters the attention's sum (times 0), so
        every slot holds finite numbers from the start."""
        cfg, weight = model.config, model.code_embedding.weight
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots + 1, cfg.num_key_value_heads, cfg.sliding_window - 1, head_dim)
        with torch.no_grad():
            zeros = functools.partial(torch.zeros, dtype=weight.dtype, device=weight.device)
            tails = tuple(zeros(slots + 1, *m.carried) for m in model.carried)
            return cls(zeros(shape), zeros(shape), tails)

    @property
    def scratch(self) -> int:
        return self.keys.shape[1] - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, *self.tails))


def load_code2wav(checkpoint_dir: str | Path, options: LoadOptions) -> Code2Wav:
    """Code2Wav from a Qwen3-Omni checkpoint directory (`code2wav.*`)."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).code2wav
    return load_model(lambda: Code2Wav(cfg), checkpoint_dir, "code2wav.", options)
