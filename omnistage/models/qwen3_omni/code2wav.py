"""Code2Wav: codec frames to a 24 kHz waveform, in one shot or streamed chunk by chunk.

codes `[B, num_quantizers, T]` → the mean of the quantizers' embeddings → a causal sliding-window
transformer → two transposed-conv upsamplers, each followed by a ConvNeXt block → a causal conv decoder
(blocks of SnakeBeta, transposed conv and dilated residual units) → samples clamped to ±1. Parameter
names equal the checkpoint's minus `code2wav.`.

Every layer is causal except the decoder's transposed convolutions, which read one input sample ahead.
So a prefix of the frames decodes to a prefix of the waveform, T frames give `samples_per_frame · T −
lookahead` samples, and the last `lookahead` samples of any prefix wait for the next frame. The streamer
uses exactly this: a chunk of frames [a, b) emits samples [spf·a − lookahead, spf·b − lookahead).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.moe import GatedMLP
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import MRotaryEmbedding, apply_rotary
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav_convs import polyphase_conv
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


def transformer_left_context(cfg: Code2WavConfig) -> int:
    """Earlier frames one frame's transformer output reads: each layer attends W − 1 frames back (itself
    and W − 1 earlier ones), and the layers compound, so L·(W − 1) (released: 8·71 = 568)."""
    return cfg.num_hidden_layers * (cfg.sliding_window - 1)


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        batch, frames, _ = x.shape

        def heads(proj: nn.Linear, count: int) -> torch.Tensor:
            return proj(x).reshape(batch * frames, count, self.head_dim)

        q = apply_rotary(heads(self.q_proj, self.num_heads), cos, sin)
        k = apply_rotary(heads(self.k_proj, self.num_kv_heads), cos, sin)
        v = heads(self.v_proj, self.num_kv_heads)
        q, k, v = (t.reshape(batch, frames, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, frames, -1))


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


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
        self, hidden: torch.Tensor, positions: torch.Tensor, absent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`hidden` `[B, T, H]` at `positions` `[B, T]`; each row's first `absent[b]` frames are not attended
        (each attends only itself, so its softmax stays defined)."""
        frames = hidden.shape[1]
        cos, sin = self.rotary_emb(positions.reshape(1, -1).expand(3, -1))
        query = torch.arange(frames, device=hidden.device)[:, None]
        key = torch.arange(frames, device=hidden.device)[None, :]
        mask = (key <= query) & (key > query - self.sliding_window)
        if absent is not None:
            mask = mask & ((key >= absent[:, None, None]) | (key == query))
        mask = mask.expand(hidden.shape[0], frames, frames)[:, None]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask)
        return self.norm(hidden)


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
        # the frames a chunk's window holds before the chunk: the transformer context ends where the
        # convolutions' begins, so the frames the decoder reads have their exact transformer output
        self.left_context = self.decoder_context + transformer_left_context(cfg)

    def num_samples(self, frames: int) -> int:
        return max(0, self.config.samples_per_frame * frames - self.lookahead)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """`[B, num_quantizers, T]` codes → `[B, T, H]`: quantizer q's codes index rows q·codebook_size + code of
        one shared table, and the quantizers' embeddings are averaged."""
        offsets = torch.arange(codes.shape[1], device=codes.device)[:, None] * self.config.codebook_size
        return self.code_embedding(codes + offsets).mean(1)

    def vocode(self, hidden: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer output `[B, T, H]` → waveform `[B, spf·T − lookahead]`; `absent` as in `decode_window`."""
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
        batch, _, frames = codes.shape
        positions = torch.arange(frames, device=codes.device).expand(batch, frames)
        return self.vocode(self.pre_transformer(self.embed(codes), positions))

    def decode_window(self, codes: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
        """The one-shot samples of each window's last n frames: `[B, spf·n]`.

        `codes` `[B, num_quantizers, left_context + n]` hold, per row, the `left_context` frames before a chunk
        and the chunk's n frames; `first_frame` `[B]` is the stream index of each window's frame 0, negative
        while the stream is younger than the context (those frames' codes are ignored). Row b's samples are
        the stream's one-shot samples [spf·a − lookahead, spf·(a + n) − lookahead) for a = first_frame[b] +
        left_context; positions before 0 hold garbage. Shapes depend only on (B, n), for CUDA graphs.

        A window of at most `left_context` frames is a stream's first n frames (`first_frame` is not read):
        nothing comes before them, so they decode as a one-shot prefix does, without the absent context's work
        (a 2-frame first chunk at the released sizes: 195 GFLOP a stream with it, ~10 without), and the result
        is laid out as above for a = 0 (its first `lookahead` positions are before sample 0).
        """
        window = codes.shape[-1]
        if window <= self.left_context:
            return F.pad(self.forward(codes), (self.lookahead, 0))
        chunk = window - self.left_context
        positions = first_frame[:, None] + torch.arange(window, device=codes.device)
        absent = (-first_frame).clamp(min=0)
        hidden = self.pre_transformer(self.embed(codes), positions, absent)
        # frames before the decoder's context are not exact (their own history was cut): drop them
        skip = self.left_context - self.decoder_context
        wav = self.vocode(hidden[:, skip:], (absent - skip).clamp(min=0))
        return wav[:, -self.config.samples_per_frame * chunk :]


def load_code2wav(checkpoint_dir: str | Path, options: LoadOptions) -> Code2Wav:
    """Code2Wav from a Qwen3-Omni checkpoint directory (`code2wav.*`)."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).code2wav
    return load_model(lambda: Code2Wav(cfg), checkpoint_dir, "code2wav.", options)
