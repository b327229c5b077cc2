"""The Triton experts' kernels compiled for an H100/H200 (sm_90) on the CPU, as the JIT compiles them there: each
tile class `default_config` picks, for the Thinker's and the Talker's layers, builds, is software-pipelined (its
loads asynchronous copies), spills no register and fits the SM's shared memory.

A tile change that spills or overflows shared memory would otherwise show only as a slow or failing start on a
GPU. Needs Triton's ahead-of-time compiler and the ptxas its wheel ships; skipped where either is missing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backend = pytest.importorskip("triton.backends.compiler")

from omnistage.kernels import moe  # noqa: E402

PTXAS = Path(pytest.importorskip("triton.backends.nvidia").__file__).parent / "bin" / "ptxas"
SM90_SHARED_BYTES = 232_448  # an H100's or H200's shared memory a block may take
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
    """`fn` for sm_90 with the hints the JIT gives these arguments at run time: every pointer and stride
    divisible by 16 (the released sizes' are), `num_pairs` unspecialized."""
    ordered = {name: args.get(name, "constexpr") for name in fn.arg_names}
    hints = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in args if n != "num_pairs"}
    source = compiler.ASTSource(fn=fn, signature=ordered, constexprs=constants, attrs=hints)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=backend.GPUTarget("cuda", 90, 32), options=options)


def _spills(ptx: str, tmp_path: Path) -> tuple[int, int]:
    """ptxas's spill stores and loads in bytes."""
    (tmp_path / "k.ptx").write_text(ptx)
    cmd = [str(PTXAS), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")]
    report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()  # type: ignore[union-attr]
    return int(stores), int(loads)


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
        assert kernel.metadata.shared <= SM90_SHARED_BYTES, f"{name}: {kernel.metadata.shared} bytes shared"
        assert _spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"{name} spills registers ({config})"
