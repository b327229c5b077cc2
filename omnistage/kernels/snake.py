"""Code2Wav's SnakeBeta activation with what its causal conv does to its output, in one Triton kernel.

In the vocoder each SnakeBeta feeds a conv, and the tensors are large (up to `[streams, 96, 48,000]` a call
at the released sizes) while the work per sample is a few flops: every pass over them is memory-bound. In
torch the activation is five kernels (multiply, sin, square, divide, add), and a causal conv's input then
takes two more passes: the zeroing of samples from before a stream began (`torch.where`) and the left pad's
copy. Here one pass reads x and writes the conv's input. The vocoder's time with and without it is in
benchmarks/RESULTS.md (benchmarks/code2wav_profile.py).

    out[b, c, :pad] = 0
    out[b, c, pad + t] = x + sin²(x·α) / (β + 1e-9)   where t >= absent[b], else 0

for x = x[b, c, t], α = e^log_alpha[c] and β = e^log_beta[c], computed in float32 whatever x's dtype. `absent` is read on the
device, so a CUDA graph captures the call and replays it for any row's.

A custom op (`torch.library.triton_op`), as the package's other kernels are: a compiled region keeps it as one
kernel. GPU only: imported where it runs (`code2wav_vocoder.SnakeBeta`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Output samples a program: long rows in blocks of 1,024 (8 a thread in 4 warps), short ones (the first
# decoder block's 140-sample rows at a 25-frame chunk) in one block of their padded width.
MIN_BLOCK, MAX_BLOCK, NUM_WARPS = 128, 1024, 4


@triton.jit
def _snake_kernel(
    x_ptr, log_alpha_ptr, log_beta_ptr, absent_ptr, out_ptr, channels, length, batch_stride, channel_stride,
    pad, MASKED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of one row (b, c) of the output, row b·channels + c on axis 0, the block on axis 1."""
    row = tl.program_id(0)
    batch, channel = row // channels, row % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = pad + length
    t = cols - pad  # the input sample each output column holds; negative in the pad
    x_row = x_ptr + batch.to(tl.int64) * batch_stride + channel.to(tl.int64) * channel_stride
    x = tl.load(x_row + t, mask=(t >= 0) & (cols < width), other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(log_alpha_ptr + channel).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(log_beta_ptr + channel).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha)
    y = x + s * s * inv_beta
    first = 0  # the first input sample kept: those before it are the pad's or a stream's absent past
    if MASKED:
        first = tl.load(absent_ptr + batch)
    # a select, not a product: an absent sample may hold anything, inf or nan included
    y = tl.where(t >= first, y, 0.0)
    tl.store(out_ptr + row.to(tl.int64) * width + cols, y.to(out_ptr.dtype.element_ty), mask=cols < width)


@triton_op("omnistage::snake", mutates_args=())
def snake(
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    pad: int = 0,
    absent: torch.Tensor | None = None,
) -> torch.Tensor:
    """SnakeBeta of `x` `[B, C, L]` (float32, fp16 or bf16; unit stride along L, e.g. a transposed conv's
    trimmed output) with per-channel `log_alpha`, `log_beta` `[C]`, each row's first `absent[b]` samples
    zeroed (none when `absent` `[B]` is None), after `pad` zeros on the left:
    `[B, C, pad + L]` in x's dtype, a causal conv's input."""
    batch, channels, length = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    width = pad + length
    out = torch.empty(batch, channels, width, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(width)))
    grid = (batch * channels, triton.cdiv(width, block))
    wrap_triton(_snake_kernel)[grid](
        x, log_alpha, log_beta, x if absent is None else absent, out, channels, length, x.stride(0),
        x.stride(1), pad, MASKED=absent is not None, BLOCK=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
