"""Code2Wav: codec frames to a 24 kHz waveform, in one shot or streamed chunk by chunk.

codes `[B, num_quantizers, T]` → the mean of the quantizers' embeddings → a causal sliding-window
transformer → two transposed-conv upsamplers, each followed by a ConvNeXt block → a causal conv decoder
(blocks of SnakeBeta, transposed conv and dilated residual units) → samples clamped to ±1. Parameter
names equal the checkpoint's minus `code2wav.`.

Every layer is causal except the decoder's transposed convolutions, which read one input sample ahead.
So a prefix of the frames decodes to a prefix of the waveform, T frames give `samples_per_frame · T −
lookahead` samples, and the last `lookahead` samples of any prefix wait for the next frame. The streamer
uses exactly this: a chunk of frames [a, b) emits samples [spf·a − lookahead, spf·b − lookahead). Of the
stream's past, a chunk reads each transformer layer's keys and values of the last W − 1 frames and the
transformer output of the last `decoder_context` frames, which its stream's slot carries from the chunk
before (`StreamSlots`, `Code2Wav.decode_chunk`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav_convs import polyphase_conv
from omnistage.models.qwen3_omni.code2wav_transformer import Code2WavTransformer, KeyValues
from omnistage.models.qwen3_omni.config import Code2WavConfig, Qwen3OmniConfig

CONV_KERNEL = 7
RESIDUAL_DILATIONS = (1, 3, 9)


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


def decoder_left_context(cfg: Code2WavConfig) -> int:
    """Transformer frames before a chunk that its first emitted sample still reads through the convolutions.

    Walk back from that sample (index −lookahead when the chunk starts at frame 0; every layer is
    shift-equivariant, so the distance is the same for any start): a causal conv of kernel k and dilation d
    reads (k − 1)·d samples back; a transposed conv's output m reads input ⌊m/s⌋ at the earliest. Released:
    −555 → −561 (final conv) → block ×3: −639 → −213, ×4: −291 → −73, ×5: −151 → −31, ×8: −109 → −14 →
    −20 (first conv) → ConvNeXt/×2: −26 → −13 → ConvNeXt/×2: −19 → −10, i.e. 10 frames.
    """
    reach = CONV_KERNEL - 1
    index = -lookahead_samples(cfg) - reach  # the final conv
    for rate in reversed(cfg.upsample_rates):
        index = (index - reach * sum(RESIDUAL_DILATIONS)) // rate
    index -= reach  # the decoder's first conv
    for ratio in reversed(cfg.upsampling_ratios):
        index = (index - reach) // ratio  # the ConvNeXt block's depthwise conv, then the upsampler
    return -index


def _zero_absent(x: torch.Tensor, absent: torch.Tensor | None, samples_per_frame: int) -> torch.Tensor:
    """`x` `[B, C, L]` with each row's first `absent[b]` frames zeroed: time before the stream began, which the
    one-shot decode sees as a causal conv's zero padding."""
    if absent is None:
        return x
    present = torch.arange(x.shape[-1], device=x.device) >= absent[:, None] * samples_per_frame
    return torch.where(present[:, None, :], x, 0)  # where, not a product: absent samples may hold anything


class CausalConv1d(nn.Module):
    """A stride-1 conv that reads only the present and the past (left zero padding of (k − 1)·d).

    Where a SnakeBeta comes before it, the conv takes it as `act`, and the activation hands back the padded
    input with the absent samples zeroed: on CUDA that is one pass over the tensor (`SnakeBeta.forward`).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        samples_per_frame: int,
        dilation: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.reach = (kernel_size - 1) * dilation
        self.samples_per_frame = samples_per_frame
        self.polyphase = False  # set by `adopt_polyphase` where it measured `polyphase_conv` faster

    def forward(
        self, x: torch.Tensor, absent: torch.Tensor | None = None, act: SnakeBeta | None = None
    ) -> torch.Tensor:
        """conv(pad(zero_absent(act(x)))); the absent samples are zeroed only where the conv reads back."""
        absent = absent if self.reach else None
        if act is not None:
            return self._conv(act(x, self.reach, absent, self.samples_per_frame))
        return self._conv(F.pad(_zero_absent(x, absent, self.samples_per_frame), (self.reach, 0)))

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        if self.polyphase:
            return polyphase_conv(x, self.conv.weight, self.conv.bias, self.conv.dilation[0])
        return self.conv(x)


class TrimmedConvTranspose1d(nn.Module):
    """Transposed conv with (kernel − stride) samples trimmed from each end: output m reads inputs ⌊m/s⌋ and,
    when kernel = 2·stride, ⌊m/s⌋ + 1."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim : x.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, samples_per_frame: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, CONV_KERNEL, samples_per_frame, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        h = self.dwconv(x, absent).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin²(x·e^α) / e^β per channel; α and β are stored as logarithms.

    Before a causal conv it also prepares the conv's input: the samples of `absent` frames zeroed, then `pad`
    zeros on the left. On CUDA one Triton kernel (`kernels/snake.py`) does all of it in one pass, where torch
    takes up to seven (the activation's five, the zeroing and the pad's copy) over the vocoder's largest
    tensors, each memory-bound (benchmarks/RESULTS.md, benchmarks/code2wav_profile.py). With `fused` False it
    takes torch's passes on every device (`torch_snake`).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.beta = nn.Parameter(torch.empty(channels))
        self.fused = True

    def forward(
        self,
        x: torch.Tensor,
        pad: int = 0,
        absent: torch.Tensor | None = None,
        samples_per_frame: int = 1,
    ) -> torch.Tensor:
        """`x` `[B, C, L]` → `[B, C, pad + L]`; `absent` `[B]` frames of `samples_per_frame` samples, or None.

        The kernel is imported here, where it runs: it needs Triton, which a CPU install may lack.
        """
        if self.fused and x.is_cuda:
            from omnistage.kernels.snake import snake

            return snake(x, self.alpha, self.beta, pad, absent, samples_per_frame)
        alpha, beta = self.alpha.exp()[:, None], self.beta.exp()[:, None]
        x = _zero_absent(x + torch.sin(x * alpha).pow(2) / (beta + 1e-9), absent, samples_per_frame)
        return F.pad(x, (pad, 0)) if pad else x


@contextmanager
def torch_snake(model: nn.Module) -> Iterator[None]:
    """`model`'s SnakeBeta activations on torch's passes inside the block, on any device: the eager path the
    GPU tests and benchmarks/code2wav_profile.py hold the kernel against."""
    acts = [m for m in model.modules() if isinstance(m, SnakeBeta)]
    fused = [act.fused for act in acts]
    for act in acts:
        act.fused = False
    try:
        yield
    finally:
        for act, was in zip(acts, fused, strict=True):
            act.fused = was


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, samples_per_frame: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, CONV_KERNEL, samples_per_frame, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1, samples_per_frame)

    def forward(self, x: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.conv2(self.conv1(x, absent, self.act1), absent, self.act2)


class DecoderBlock(nn.Module):
    """SnakeBeta, a transposed conv upsampling by `rate` (halving the channels), three residual units."""

    def __init__(self, in_dim: int, rate: int, samples_per_frame: int) -> None:
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), TrimmedConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d, samples_per_frame) for d in RESIDUAL_DILATIONS]
        )

    def forward(self, x: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        act, upsample, *units = self.block
        x = upsample(act(x))
        for unit in units:
            x = unit(x, absent)
        return x


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, hidden)
        self.pre_transformer = Code2WavTransformer(cfg)
        rate = 1  # samples per frame at each stage's output
        upsample = []
        for ratio in cfg.upsampling_ratios:
            rate *= ratio
            upsample.append(
                nn.ModuleList(
                    [TrimmedConvTranspose1d(hidden, hidden, ratio, ratio), ConvNeXtBlock(hidden, rate)]
                )
            )
        self.upsample = nn.ModuleList(upsample)
        decoder: list[nn.Module] = [CausalConv1d(hidden, cfg.decoder_dim, CONV_KERNEL, rate)]
        for i, block_rate in enumerate(cfg.upsample_rates):
            rate *= block_rate
            decoder.append(DecoderBlock(cfg.decoder_dim // 2**i, block_rate, rate))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        decoder += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, CONV_KERNEL, rate)]
        self.decoder = nn.ModuleList(decoder)
        self.lookahead = lookahead_samples(cfg)
        self.decoder_context = decoder_left_context(cfg)

    def num_samples(self, frames: int) -> int:
        return max(0, self.config.samples_per_frame * frames - self.lookahead)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """`[B, num_quantizers, T]` codes → `[B, T, H]`: quantizer q's codes index rows q·codebook_size + code of
        one shared table, and the quantizers' embeddings are averaged."""
        offsets = torch.arange(codes.shape[1], device=codes.device)[:, None] * self.config.codebook_size
        return self.code_embedding(codes + offsets).mean(1)

    def vocode(self, hidden: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer output `[B, T, H]` → waveform `[B, spf·T − lookahead]`; each row's first `absent[b]`
        frames stand for the time before its stream began (the one-shot decode's zero padding)."""
        x = hidden.transpose(1, 2)
        # each entry is a ModuleList of (upsampler, ConvNeXt block): nn.ModuleList is not generic
        for upsampler, convnext in cast("Iterable[nn.ModuleList]", self.upsample):
            x = convnext(upsampler(x), absent)
        first, *blocks, act, last = self.decoder
        x = first(x, absent)
        for block in blocks:
            x = block(x, absent)
        return last(x, absent, act)[:, 0].clamp(-1, 1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot decode: codes `[B, num_quantizers, T]` → waveform `[B, spf·T − lookahead]`."""
        start = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        return self.vocode(self.pre_transformer(self.embed(codes), start)[0])

    def decode_chunk(
        self,
        codes: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        state: StreamSlots,
        context: bool = True,
    ) -> torch.Tensor:
        """The one-shot samples of each stream's next n frames, its past carried in `state`: `[B, spf·n]`.

        Row b holds frames [a, a + n) of a stream (`codes` `[B, num_quantizers, n]`, a = start[b]), whose state
        is in slot slots[b]: what its frames before a left there (anything when a = 0: it is masked), and, after
        the call, what these frames leave. Row b's samples are the stream's one-shot samples [spf·a − lookahead,
        spf·(a + n) − lookahead); positions before sample 0 hold garbage. Rows share no slot but the scratch
        one. Shapes depend only on (B, n), for CUDA graphs.

        With `context` False every row must start its stream (a = 0), and the convolutions read its frames
        alone, as the one-shot decode of a prefix does, without the `decoder_context` frames a later chunk's
        read before it (a 2-frame first chunk: 9.0 instead of 58 GFLOP a stream at the released sizes).
        """
        past = KeyValues(state.keys[:, slots], state.values[:, slots])
        hidden, kept = self.pre_transformer(self.embed(codes), start, past)
        frames = torch.cat([state.hidden[slots], hidden], dim=1)  # read before the slots are written
        state.keys.index_copy_(1, slots, kept.keys)
        state.values.index_copy_(1, slots, kept.values)
        state.hidden.index_copy_(0, slots, frames[:, frames.shape[1] - self.decoder_context :])
        if not context:
            return F.pad(self.vocode(hidden), (self.lookahead, 0))
        wav = self.vocode(frames, (self.decoder_context - start).clamp(min=0))
        return wav[:, -self.config.samples_per_frame * codes.shape[-1] :]


@dataclass(frozen=True)
class StreamSlots:
    """What each stream's chunks leave for its next, in a slot per stream: every transformer layer's keys and
    values of its last W − 1 frames, and the transformer output of its last `decoder_context` frames, which
    the next chunk's convolutions read (released: 2.3 MB a slot in bf16). The last slot is scratch, written by
    padding rows."""

    keys: torch.Tensor  # [layers, slots + 1, kv_heads, W − 1, head_dim]
    values: torch.Tensor
    hidden: torch.Tensor  # [slots + 1, decoder_context, H]

    @classmethod
    def allocate(cls, model: Code2Wav, slots: int) -> StreamSlots:
        """Zeros on the model's device: a masked key's value still enters the attention's sum (times 0), so
        every slot holds finite numbers from the start."""
        cfg, weight = model.config, model.code_embedding.weight
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots + 1, cfg.num_key_value_heads, cfg.sliding_window - 1, head_dim)
        with torch.no_grad():
            zeros = functools.partial(torch.zeros, dtype=weight.dtype, device=weight.device)
            return cls(zeros(shape), zeros(shape), zeros(slots + 1, model.decoder_context, cfg.hidden_size))

    @property
    def scratch(self) -> int:
        return self.hidden.shape[0] - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.hidden))


def load_code2wav(checkpoint_dir: str | Path, options: LoadOptions) -> Code2Wav:
    """Code2Wav from a Qwen3-Omni checkpoint directory (`code2wav.*`)."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).code2wav
    return load_model(lambda: Code2Wav(cfg), checkpoint_dir, "code2wav.", options)
