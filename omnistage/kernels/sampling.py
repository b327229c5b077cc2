"""`static_sampling.sample_static` on CUDA as one Triton kernel, one program per row over the vocabulary.

In torch a call is ~12 kernels (argmax, temperature, topk, softmax, cumsum, top-p, noise, race, gather), and a
code-predictor frame makes 15 calls: its time is launches. Here a program loads its row of logits, divides by
the temperature, selects the top k by `tl.topk` over the int64 keys of `static_sampling.sort_keys` (distinct,
so exactly torch's top k in torch's order), weighs them, cuts them by top-p on the same integer masses, races
them against the same hashed noise and writes the id and the row's next draw number.

It draws what `sample_torch` draws, bit for bit, because every float step is one IEEE operation or one call
of the CUDA math library's expf/logf (libdevice: what torch's exp and log call): divisions round to nearest
(`div_rn`; Triton's `/` is approximate), the uniform's scale is a power-of-two product, and the only sums are
of integers. Triton flushes denormal results of libdevice to zero where torch keeps them; that changes only a
weight below 2**-126 of the top one, which is no mass in top-p's fixed point and cannot win the race (the top
rank scores at least 1 / 17, and no noise the hash makes lifts a weight below 2**-29 that high). GPU only: a
CPU install has no Triton and takes the torch path (`engine/static_sampling.py`); the numbers both paths use
are in `sampling_spec.py`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnistage.kernels.sampling_spec import GOLDEN, MASS_SCALE, MIX1, MIX2, check_top_k

_LOWEST_KEY = -(2**63)  # columns past the vocabulary: below every real key, so never in the top k


class SamplingRows(Protocol):
    """What the kernel reads of `static_sampling.StaticRows`: a batch's settings as device tensors `[B]`."""

    greedy: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    draws: torch.Tensor


@triton.jit
def _mix(x, mix1, mix2):
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * mix1
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * mix2
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@triton.jit
def _flip_negative(bits):
    """A float's int32 bits <-> an int32 in the float's order (an involution: the sign bit is kept)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# Unspecialized: top_k varies per batch; a new divisibility class would build mid-request (compile_watch.py).
@triton.jit(do_not_specialize=["top_k"])
def _sample_kernel(
    logits_ptr, greedy_ptr, temperature_ptr, top_p_ptr, seeds_ptr, draws_ptr, out_ptr,
    vocab, stride, top_k, mass_scale, golden, mix1, mix2, LOWEST_KEY: tl.constexpr,
    V_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    greedy = tl.load(greedy_ptr + row)
    divisor = tl.where(greedy, 1.0, tl.load(temperature_ptr + row))
    cols = tl.arange(0, V_BLOCK)
    in_vocab = cols < vocab
    logits = tl.load(logits_ptr + row * stride + cols, mask=in_vocab, other=0.0)
    ordered = _flip_negative(tl.math.div_rn(logits, divisor).to(tl.int32, bitcast=True))
    keys = tl.where(in_vocab, (ordered.to(tl.int64) << 32) | (vocab - 1 - cols).to(tl.int64), LOWEST_KEY)

    top = tl.topk(keys, K_BLOCK)  # descending
    ranks = tl.arange(0, K_BLOCK)
    ids = vocab - 1 - (top & 0xFFFFFFFF)
    head = _flip_negative((top >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    first = tl.sum(tl.where(ranks == 0, head, 0.0), axis=0)
    kept = ranks < top_k
    weights = tl.where(kept, libdevice.exp(head - first), 0.0)

    mass = (weights * mass_scale).to(tl.int64)
    total = tl.sum(mass, axis=0).to(tl.float64)
    top_p = tl.load(top_p_ptr + row).to(tl.float64)
    cut = (tl.cumsum(mass, axis=0) - mass).to(tl.float64) >= top_p * total

    seed = tl.load(seeds_ptr + row)
    draw = tl.load(draws_ptr + row)
    bits = _mix(_mix(seed * golden + draw, mix1, mix2) + (ranks.to(tl.int64) + 1) * golden, mix1, mix2)
    uniform = (((bits >> 41) & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 2**-23: exact
    score = tl.math.div_rn(tl.where(cut, 0.0, weights), -libdevice.log(uniform))
    choice = tl.argmax(tl.where(kept, score, -1.0), axis=0)  # the first on a tie, as torch's argmax

    pick = tl.where(greedy, 0, choice)
    tl.store(out_ptr + row, tl.sum(tl.where(ranks == pick, ids, 0), axis=0))
    tl.store(draws_ptr + row, draw + 1)


def sample_kernel(logits: torch.Tensor, rows: SamplingRows, top_k: int, num_warps: int = 4) -> torch.Tensor:
    """`sample_static` for float32 `logits` `[B, V]` (unit column stride) on CUDA: ids `[B]` (int64); the first
    B of `rows.draws` advance by one in place. One program per row, of `num_warps` warps."""
    batch, vocab = logits.shape
    check_top_k(top_k, vocab)
    if logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError(f"logits {logits.dtype} of strides {logits.stride()}: float32 of unit column stride")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    k_block = max(2, triton.next_power_of_2(top_k))  # tl.topk takes k >= 2
    _sample_kernel[(batch,)](
        logits, rows.greedy, rows.temperature, rows.top_p, rows.seeds, rows.draws, out,
        vocab, logits.stride(0), top_k, MASS_SCALE, GOLDEN, MIX1, MIX2, LOWEST_KEY=_LOWEST_KEY,
        V_BLOCK=triton.next_power_of_2(vocab), K_BLOCK=k_block, num_warps=num_warps,
    )  # fmt: skip
    return out
