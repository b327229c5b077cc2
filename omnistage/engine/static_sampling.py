"""Sampling a CUDA graph can hold: per-row settings in device tensors, and noise from a counter-based hash.

The engine's Sampler draws a seeded row from its own torch.Generator, one call per row, with settings built
from Python lists each step: right for the Thinker, but a graph replays neither. Here a row's noise is a pure
function of (its seed, its draw number, the token's rank): the same for the row alone or in any batch, and the
draw numbers advance on the device. The hash is SplitMix64's finaliser over int64 arithmetic (wrapping, as
torch's integer ops do), whose top 23 bits make a uniform in (0, 1); `-log(u)` is then an Exp(1) draw for the
exponential race (argmax of p / q is an exact draw from p).

Every step is defined so that any order of evaluation gives the same bits, which is what lets one Triton
kernel per call on CUDA (kernels/sampling.py) draw exactly what the torch path here draws: ranks come from
distinct int64 keys (tied logits rank by token id, lower first), and top-p sums the kept weights as integers
(fixed point, 2**-40 of the top weight), so no float sum's order matters; the rest is elementwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.kernels.sampling_spec import GOLDEN, MASS_SCALE, MIX1, MIX2, check_top_k
from omnistage.models.layers.attention_metadata import to_device_together

log = logging.getLogger(__name__)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (logical shifts emulated by masking the sign-extended bits)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` float32 uniforms in (0, 1): row b's depend only on (seeds[b], draws[b]) and the column."""
    columns = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    key = _mix(seeds * GOLDEN + draws)  # [B]
    bits = _mix(key[:, None] + (columns[None, :] + 1) * GOLDEN)
    # the top 23 bits: (k + 0.5) / 2**23 is exact in float32 and lies in [2**-24, 1 - 2**-24]
    top23 = (bits >> 41) & ((1 << 23) - 1)
    return (top23.float() + 0.5) / float(1 << 23)


@dataclass
class StaticRows:
    """A batch's sampling settings as device tensors of fixed size (rows past the batch are padding)."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32 (1 where greedy)
    top_p: torch.Tensor  # [B] float32 (inf: off)
    seeds: torch.Tensor  # [B] int64
    draws: torch.Tensor  # [B] int64: the draw number of each row's next sample; advanced by every call

    @classmethod
    def empty(cls, rows: int, device: torch.device | str) -> StaticRows:
        return cls(
            torch.ones(rows, dtype=torch.bool, device=device),
            torch.ones(rows, device=device),
            torch.full((rows,), math.inf, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
        )

    def fill(
        self,
        greedy: Sequence[bool],
        temperature: Sequence[float],
        top_p: Sequence[float],
        seeds: Sequence[int],
        draws: Sequence[int],
    ) -> None:
        """Set the first len(greedy) rows (the rest keep their values) from one pinned host-to-device copy: a
        copy from pageable memory waits for the stream's queued work first, once per field."""
        n = len(greedy)
        fields = (
            (self.greedy, greedy),
            (self.temperature, [1.0 if g else t for g, t in zip(greedy, temperature)]),
            (self.top_p, [p if p < 1.0 else math.inf for p in top_p]),
            (self.seeds, seeds),
            (self.draws, draws),
        )
        hosts = [torch.tensor(values, dtype=target.dtype) for target, values in fields]
        for (target, _), values in zip(fields, to_device_together(hosts, self.seeds.device)):
            target[:n].copy_(values)


def sort_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys `[B, V]` of float32 `x` in x's order, ties towards the lower column: the float's bits as an
    order-keeping int32 in the high half, V - 1 - column in the low half. A row's keys are distinct, so its top
    k are one set in one order, however they are selected."""
    bits = x.view(torch.int32)
    # a negative float's magnitude bits flipped: the larger float, the larger int
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    reverse = torch.arange(x.shape[-1] - 1, -1, -1, device=x.device)
    return (ordered.long() << 32) | reverse


def sample_static(logits: torch.Tensor, rows: StaticRows, top_k: int) -> torch.Tensor:
    """Ids `[B]` from float32 logits `[B, V]`: greedy rows take the argmax; the others temperature, their top
    `top_k` (the same for every row: a static shape), top-p, then the exponential race on hashed noise. No host
    synchronisation; `rows.draws` advances by one. On CUDA one Triton kernel (kernels/sampling.py), elsewhere
    `sample_torch`: the same draws."""
    global _kernel_failed
    if logits.is_cuda and not _kernel_failed:
        # ~12 kernels a call in torch, 15 calls a code-predictor frame: launches set its time
        from omnistage.kernels.sampling import sample_kernel

        try:
            return sample_kernel(logits, rows, top_k)
        except Exception:  # a Triton build that cannot compile it: the torch path draws the same, slower
            log.exception("the sampling kernel failed; code-predictor sampling runs in torch ops from now on")
            _kernel_failed = True
    return sample_torch(logits, rows, top_k)


_kernel_failed = False


def sample_torch(logits: torch.Tensor, rows: StaticRows, top_k: int) -> torch.Tensor:
    """`sample_static` in torch ops. A greedy row's id is its top key's (the argmax, the lowest id on a tie)."""
    batch, vocab = logits.shape
    check_top_k(top_k, vocab)
    scaled = logits / torch.where(rows.greedy[:batch, None], 1.0, rows.temperature[:batch, None])
    order = vocab - 1 - (sort_keys(scaled).topk(top_k, dim=-1).values & 0xFFFFFFFF)
    head = scaled.gather(1, order)
    weights = (head - head[:, :1]).exp()
    mass = (weights * MASS_SCALE).long()
    total = mass.sum(dim=-1, keepdim=True).double()
    cut = (mass.cumsum(dim=-1) - mass).double() >= rows.top_p[:batch, None].double() * total
    noise = -uniform_noise(rows.seeds[:batch], rows.draws[:batch], top_k).log()
    choice = (weights.masked_fill(cut, 0.0) / noise).argmax(dim=-1)
    rows.draws[:batch] += 1
    return torch.where(rows.greedy[:batch], order[:, 0], order.gather(1, choice[:, None])[:, 0])
