"""Code2Wav's convolutions, run over a whole stream at once or over its next chunk with what the chunk before
left them (`Carry`).

A causal conv of kernel k and dilation d reads (k − 1)·d samples back; a decoder block's transposed conv
(kernel 2s, stride s, s trimmed from each end) writes output m from inputs ⌊m/s⌋ and ⌊m/s⌋ + 1, one ahead.
Streamed, each causal conv is given its input's last (k − 1)·d samples from the chunk before in place of its
zero padding, and each such transposed conv its input's last sample before the chunk's, so that it writes
the s samples that waited for this chunk's first input and leaves out the s that wait for the next chunk's:
a chunk of n frames yields spf·n samples, each layer's output lagging its input by what the transposed
convs before it hold back (released: 8, 45, 184 and 555 samples after the four blocks, the last being
`lookahead_samples`). On a stream's first chunk the lagged samples stand before the stream's sample 0: they
are zeroed before every causal conv reads them (the one-shot decode's zero padding), and the carried samples
are zeros.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.qwen3_omni.code2wav_convs import polyphase_conv

CONV_KERNEL = 7
RESIDUAL_DILATIONS = (1, 3, 9)


class Carry:
    """A call's samples carried across chunk boundaries: per module that reads across one (`Code2Wav.carried`),
    its streams' samples from before the chunk (`before`, as their slots hold them) and, once the call has run,
    what the chunk leaves for the next (`left`). `fresh` `[B]`: the rows whose stream starts with this chunk,
    whose carried samples are read as zeros whatever their slot holds."""

    def __init__(self, before: dict[nn.Module, torch.Tensor], fresh: torch.Tensor) -> None:
        self.before, self.fresh = before, fresh
        self.left: dict[nn.Module, torch.Tensor] = {}

    def read(self, module: nn.Module) -> torch.Tensor:
        """`module`'s carried samples `[B, C, k]`: zeros on fresh rows."""
        return torch.where(self.fresh[:, None, None], 0, self.before[module])

    def keep(self, module: nn.Module, tail: torch.Tensor) -> None:
        """`tail` `[B, C, k]`, the last k samples of `module`'s input, carried ones included: what it leaves."""
        self.left[module] = tail.clone()

    def absent(self, lag: int) -> torch.Tensor | None:
        """Samples before the stream's sample 0 at the head of an input lagging by `lag`: `lag` on fresh rows."""
        return self.fresh.long() * lag if lag else None


def _zero_absent(x: torch.Tensor, absent: torch.Tensor | None) -> torch.Tensor:
    """`x` `[B, C, L]` with each row's first `absent[b]` samples zeroed: time before the stream began, which the
    one-shot decode sees as a causal conv's zero padding."""
    if absent is None:
        return x
    present = torch.arange(x.shape[-1], device=x.device) >= absent[:, None]
    return torch.where(present[:, None, :], x, 0)  # where, not a product: absent samples may hold anything


class SnakeBeta(nn.Module):
    """x + sin²(x·e^α) / e^β per channel; α and β are stored as logarithms.

    Before a causal conv it also prepares the conv's input: the `absent` samples zeroed, then `pad` zeros on
    the left. On CUDA one Triton kernel (`kernels/snake.py`) does all of it in one pass, where torch takes up
    to seven (the activation's five, the zeroing and the pad's copy) over the vocoder's largest tensors, each
    memory-bound (benchmarks/RESULTS.md, benchmarks/code2wav_profile.py). With `fused` False it takes torch's
    passes on every device (`torch_snake`).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.beta = nn.Parameter(torch.empty(channels))
        self.fused = True

    def forward(self, x: torch.Tensor, pad: int = 0, absent: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[B, C, L]` → `[B, C, pad + L]`; `absent` `[B]` samples, or None.

        The kernel is imported here, where it runs: it needs Triton, which a CPU install may lack.
        """
        if self.fused and x.is_cuda:
            from omnistage.kernels.snake import snake

            return snake(x, self.alpha, self.beta, pad, absent)
        alpha, beta = self.alpha.exp()[:, None], self.beta.exp()[:, None]
        x = _zero_absent(x + torch.sin(x * alpha).pow(2) / (beta + 1e-9), absent)
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


class CausalConv1d(nn.Module):
    """A stride-1 conv that reads only the present and the past: (k − 1)·d samples of left zero padding, or,
    given a `Carry`, the stream's samples before the chunk, its input lagging by `lag` samples.

    Where a SnakeBeta comes before it, the conv takes it as `act`, and the activation hands back the padded
    input with the absent samples zeroed: on CUDA that is one pass over the tensor (`SnakeBeta.forward`).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        lag: int = 0,
        dilation: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.reach = (kernel_size - 1) * dilation
        self.lag = lag
        self.carried: tuple[int, int] = (in_channels, self.reach)  # [C, k] carried across chunks
        self.polyphase = False  # set by `adopt_polyphase` where it measured `polyphase_conv` faster

    def forward(
        self, x: torch.Tensor, act: SnakeBeta | None = None, carry: Carry | None = None
    ) -> torch.Tensor:
        """conv(carried or zeros ++ zero_absent(act(x)))."""
        if not self.reach:
            return self._conv(x if act is None else act(x))
        absent = None if carry is None else carry.absent(self.lag)
        if act is not None:
            x = act(x, self.reach, absent)
        else:
            x = F.pad(_zero_absent(x, absent), (self.reach, 0))
        if carry is not None:
            x[..., : self.reach] = carry.read(self)
            carry.keep(
                self, x[..., x.shape[-1] - self.reach :]
            )  # a chunk shorter than the reach: some carried
        return self._conv(x)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        if self.polyphase:
            return polyphase_conv(x, self.conv.weight, self.conv.bias, self.conv.dilation[0])
        return self.conv(x)


class TrimmedConvTranspose1d(nn.Module):
    """Transposed conv with (kernel − stride) samples trimmed from each end: output m reads inputs ⌊m/s⌋ and,
    when kernel = 2·stride, ⌊m/s⌋ + 1. Given a `Carry`, such a conv reads its input's last sample before the
    chunk first: n inputs then yield s·n samples, starting s before the chunk's."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride
        self.carried: tuple[int, int] = (in_channels, 1 if self.trim else 0)

    def forward(self, x: torch.Tensor, carry: Carry | None = None) -> torch.Tensor:
        if carry is not None and self.trim:
            x = torch.cat([carry.read(self), x], dim=-1)
            carry.keep(self, x[..., x.shape[-1] - 1 :])
        x = self.conv(x)
        return x[..., self.trim : x.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, CONV_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, carry: Carry | None = None) -> torch.Tensor:
        h = self.dwconv(x, carry=carry).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, lag: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, CONV_KERNEL, lag, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1, lag)

    def forward(self, x: torch.Tensor, carry: Carry | None = None) -> torch.Tensor:
        return x + self.conv2(self.conv1(x, self.act1, carry), self.act2, carry)


class DecoderBlock(nn.Module):
    """SnakeBeta, a transposed conv upsampling by `rate` (halving the channels), three residual units; `lag`:
    the samples its output lags a chunk's, streamed."""

    def __init__(self, in_dim: int, rate: int, lag: int) -> None:
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), TrimmedConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d, lag) for d in RESIDUAL_DILATIONS]
        )

    def forward(self, x: torch.Tensor, carry: Carry | None = None) -> torch.Tensor:
        act, upsample, *units = self.block
        x = upsample(act(x), carry)
        for unit in units:
            x = unit(x, carry)
        return x
