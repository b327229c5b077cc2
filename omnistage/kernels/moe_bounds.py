"""Where the GPU's MoE paths switch, in token-expert pairs: `SparseMoeBlock` (models/layers/moe.py) picks its
experts' kernel by them, `moe_align.align_pairs` its alignment, and the warm-up runs each side of each switch.

No Triton here: the warm-up's shapes are worked out on any machine (`moe.kernel_switches`).
"""

# Token-expert pairs up to which "auto" takes the Triton kernel (decode batches); grouped GEMMs above.
TRITON_MAX_PAIRS = 512
# Pairs up to which the grouped GEMMs' alignment runs as one Triton program (moe_align.py); past them (prefill)
# a stable sort in torch, whose cost grows as P log P where the program's one-hot grows as P·E.
ALIGN_KERNEL_MAX_PAIRS = 4096
