"""The numbers the sampling kernel (`sampling.py`) and its torch twin (`engine/static_sampling.py`) share to
draw the same bits: SplitMix64's constants for the counter-based noise, top-p's fixed point, the top-k bound.

No Triton here: the torch path, which runs on the CPU, imports them too.
"""

from __future__ import annotations

GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB

# top-p sums the kept weights (the top one is 1) in this fixed point; up to MAX_TOP_K of them stay under 2**52,
# exact as int64 and as float64 (top-p's threshold is one float64 product)
MASS_SCALE = 2.0**40
MAX_TOP_K = 4096


def check_top_k(top_k: int, vocab: int) -> None:
    if not 0 < top_k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"top_k {top_k} is not in [1, min(vocab {vocab}, {MAX_TOP_K})]")
