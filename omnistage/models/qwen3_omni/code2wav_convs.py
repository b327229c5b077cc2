"""Code2Wav's dilated convs in another form where cuDNN serves their shapes badly on a GPU: one undilated conv
over the input's phases (`adopt_polyphase` measures where that is faster at start-up)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.timing import cuda_ms

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.code2wav import Code2Wav

log = logging.getLogger(__name__)


def polyphase_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int
) -> torch.Tensor:
    """`F.conv1d(x, weight, bias, dilation=dilation)` as one undilated conv over the `dilation` phases of `x`:
    output t = q·d + r reads inputs (q + k)·d + r, so phase r of the output is the undilated conv of phase r
    of the input. `x` is padded on the right to whole phases, and the extra outputs dropped."""
    batch, channels, samples = x.shape
    taps = weight.shape[-1]
    length = samples - (taps - 1) * dilation
    rows = -(-length // dilation) + taps - 1  # each phase's inputs
    x = F.pad(x, (0, rows * dilation - samples))
    phases = x.view(batch, channels, rows, dilation).permute(0, 3, 1, 2).reshape(-1, channels, rows)
    y = F.conv1d(phases, weight, bias)  # [batch · dilation, out, rows − taps + 1]
    y = y.view(batch, dilation, -1, y.shape[-1]).permute(0, 2, 3, 1)
    return y.reshape(batch, y.shape[1], -1)[..., :length]


POLYPHASE_MARGIN = 0.15  # a conv takes the polyphase form where it is this much faster: not for noise


def adopt_polyphase(
    model: Code2Wav, streams: int, chunk: int, timer: Callable[[Callable[[], object]], float] | None = None
) -> list[str]:
    """Put `model`'s dilated convs on `polyphase_conv` where, timed at their inputs' shapes in a call of
    `streams` chunks of `chunk` frames, it beats `nn.Conv1d` by more than
    POLYPHASE_MARGIN. cuDNN picks its algorithm by heuristics, and for some dilated shapes a slow generic
    kernel (benchmarks/RESULTS.md, "Under load, a fourth time"). `timer`: ms of a call (CUDA events by
    default). Returns the convs' names, and logs each one's times."""
    from omnistage.models.qwen3_omni.code2wav import StreamSlots  # whose convs import this module's
    from omnistage.models.qwen3_omni.code2wav_vocoder import CausalConv1d

    timer = timer or cuda_ms
    dilated = [
        (n, m) for n, m in model.named_modules() if isinstance(m, CausalConv1d) and m.conv.dilation[0] > 1
    ]
    shapes: dict[str, torch.Size] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:  # None: the conv's input unchanged
            shapes.setdefault(name, args[0].shape)

        return hook

    hooks = [m.conv.register_forward_pre_hook(record(n)) for n, m in dilated]
    weight = model.code_embedding.weight
    codes = torch.zeros(streams, model.config.num_quantizers, chunk, dtype=torch.long, device=weight.device)
    zeros = torch.zeros(streams, dtype=torch.long, device=weight.device)  # frame 0, in the scratch slot
    try:
        with torch.inference_mode():
            model.decode_chunk(codes, zeros, zeros, StreamSlots.allocate(model, 0))
    finally:
        for hook in hooks:
            hook.remove()
    adopted = []
    for name, module in dilated:
        x = torch.randn(shapes[name], dtype=weight.dtype, device=weight.device)
        plain, phased = _times(module.conv, x, timer)
        module.polyphase = phased < plain * (1 - POLYPHASE_MARGIN)
        if module.polyphase:
            adopted.append(name)
        log.info(
            "Code2Wav conv %s at %s: %.2f ms, polyphase %.2f ms; %s",
            name, tuple(x.shape), plain, phased, "polyphase" if module.polyphase else "as it is",
        )  # fmt: skip
    return adopted


def _times(
    conv: nn.Conv1d, x: torch.Tensor, timer: Callable[[Callable[[], object]], float]
) -> tuple[float, float]:
    """ms of `conv` on `x` as it is, and in the polyphase form."""
    with torch.inference_mode():
        return timer(lambda: conv(x)), timer(
            lambda: polyphase_conv(x, conv.weight, conv.bias, conv.dilation[0])
        )
