"""Where the GPU's MoE paths switch: `kernels.moe.default_config` picks the Triton experts' tiles by the pairs an
expert gets, `moe_align.align_pairs` its alignment by the token-expert pairs, and the warm-up runs each side of
each switch (`models.layers.moe.kernel_switches`).

No Triton here: the warm-up's shapes are worked out on any machine.
"""

# Mean token-expert pairs an expert gets up to which the 16-row tiles (decode) serve, then the 32-row ones; the
# 64-row ones serve below TALL_TILES_FROM, the tall ones (128 rows, wider N) from it: a 2,048-token prefill
# chunk of the Thinker, where they took 816 µs against 877 and 1,800 against 2,271 at 8,192 tokens on an H100
# (benchmarks/RESULTS.md, "The routed experts on the Triton kernel at prefill sizes").
TILE_SWITCHES = (8, 32)
TALL_TILES_FROM = 128
# Pairs up to which the alignment runs as one Triton program (moe_align.py); past them (prefill) a stable sort
# in torch, whose cost grows as P log P where the program's one-hot grows as P·E.
ALIGN_KERNEL_MAX_PAIRS = 4096
