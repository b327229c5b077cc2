"""The Triton experts' kernels compiled for an H100/H200 (sm_90) on the CPU, as the JIT compiles them there: each
tile class `default_config` picks, for the Thinker's and the Talker's layers, builds, is software-pipelined (its
loads asynchronous copies), spills no register and fits the SM's shared memory.

A tile change that spills or overflows shared memory would otherwise show only as a slow or failing start on a
GPU. Needs Triton's ahead-of-time compiler and the ptxas its wheel ships; skipped where either is missing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton.compiler")

from sm90 import PTXAS, SHARED_BYTES, compile_sm90, spills  # noqa: E402

from omnistage.kernels import moe  # noqa: E402

# (experts, hidden, expert width, top-k) of the released Qwen3-Omni's Thinker and Talker
STAGES = {"thinker": (128, 2048, 768, 8), "talker": (128, 1024, 384, 6)}
TOKENS = (1, 256, 1024, 8192)  # one in each tile class for both stages: 16-, 32-, 64- and 128-row blocks

# the kernels' tensor and integer arguments, as their JIT sees them (the rest are constexprs)
GATE_UP_ARGS = {
    **dict.fromkeys(("x_ptr", "w13_ptr", "hidden_ptr"), "*bf16"),
    **dict.fromkeys(("pair_ids_ptr", "block_expert_ptr"), "*i32"),
    **dict.fromkeys(("num_pairs", "stride_xt", "stride_we", "stride_wn", "stride_ht"), "i32"),
}
DOWN_ARGS = {
    **dict.fromkeys(("hidden_ptr", "w2_ptr", "out_ptr", "weights_ptr"), "*bf16"),
    **dict.fromkeys(("pair_ids_ptr", "block_expert_ptr"), "*i32"),
    **dict.fromkeys(("num_pairs", "stride_ht", "stride_we", "stride_wn", "stride_op"), "i32"),
}


def _compile(fn, args: dict[str, str], constants: dict[str, object], config: moe.MoeKernelConfig):
    return compile_sm90(fn, args, constants, config.num_warps, config.num_stages)


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")
@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("tokens", TOKENS)
def test_each_tile_class_compiles_pipelined_without_spills(stage, tokens, tmp_path):
    experts, hidden, inter, top_k = STAGES[stage]
    config = moe.default_config(tokens * top_k, experts)
    common = {"PRECISION": "tf32", "N_INNER": config.n_inner, "BLOCK_M": config.block_m}
    gate_up = {"TOP_K": top_k, "INTER": inter, "HIDDEN": hidden, "BLOCK_N": config.gate_up_n}
    down = {"HIDDEN": hidden, "INTER": inter, "BLOCK_N": config.down_n, "BLOCK_K": config.down_k}
    kernels = {
        "gate-up": _compile(
            moe._gate_up_kernel, GATE_UP_ARGS, {**common, **gate_up, "BLOCK_K": config.gate_up_k}, config
        ),
        "down": _compile(moe._down_kernel, DOWN_ARGS, {**common, **down}, config),
    }
    for name, kernel in kernels.items():
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], f"{name}: its loads are not pipelined"
        assert kernel.metadata.shared <= SHARED_BYTES, f"{name}: {kernel.metadata.shared} bytes shared"
        assert spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"{name} spills registers ({config})"
