"""The last part of `static_sampling.sample_static` as one Triton kernel: hashed noise, exponential race, draw.

Eagerly (and in a captured graph alike) the counter-based noise is ~30 elementwise kernels per call, and the
code predictor calls it 15 times a frame. Here one program per row computes the same SplitMix64 hash over
int64 (wrapping, arithmetic shifts masked into logical ones), the same uniforms in (0, 1), picks
argmax(p / -log u) (the first on a tie, as torch's argmax) and advances the row's draw number in place. GPU
only: a CPU install has no Triton and takes the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnistage.engine.static_sampling import _GOLDEN, _MIX1, _MIX2


@triton.jit
def _mix(x, mix1, mix2):
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * mix1
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * mix2
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@triton.jit
def _race_kernel(
    probs_ptr, seeds_ptr, draws_ptr, out_ptr, k, stride, golden, mix1, mix2, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    draw = tl.load(draws_ptr + row)
    key = _mix(seed * golden + draw, mix1, mix2)
    cols = tl.arange(0, BLOCK)
    mask = cols < k
    bits = _mix(key + (cols.to(tl.int64) + 1) * golden, mix1, mix2)
    top23 = (bits >> 41) & 0x7FFFFF
    uniform = (top23.to(tl.float32) + 0.5) / 8388608.0
    probs = tl.load(probs_ptr + row * stride + cols, mask=mask, other=0.0)
    score = tl.where(mask, probs / -tl.log(uniform), -1.0)
    tl.store(out_ptr + row, tl.argmax(score, axis=0).to(tl.int64))
    tl.store(draws_ptr + row, draw + 1)


def race(probs: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Column `[B]` (int64) each row of float32 `probs` `[B, K]` draws with its (seed, draw number); the draw
    numbers `[B]` (contiguous int64) advance by one in place."""
    batch, k = probs.shape
    out = torch.empty(batch, dtype=torch.int64, device=probs.device)
    _race_kernel[(batch,)](
        probs, seeds, draws, out, k, probs.stride(0), _GOLDEN, _MIX1, _MIX2, BLOCK=triton.next_power_of_2(k)
    )
    return out
