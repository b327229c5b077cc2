"""Triton kernels compiled for an H100/H200 (sm_90) on the CPU, as the JIT compiles them there: Triton's
ahead-of-time compiler with the divisibility hints the JIT gives their arguments, and the ptxas its wheel ships.

Compiled without those hints, the same kernels come out unpipelined and may spill: a check that omits them
would mislead.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTXAS = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
SHARED_BYTES = 232_448  # an H100's or H200's shared memory a block may take


def compile_sm90(fn, args: dict[str, str], constants: dict[str, object], num_warps: int, num_stages: int):
    """`fn` for sm_90: `args` its tensor and integer arguments' types (the rest are `constants`), every one
    hinted divisible by 16 (the released sizes' pointers and strides are) except those the JIT leaves
    unspecialized."""
    ordered = {name: args.get(name, "constexpr") for name in fn.arg_names}
    loose = {n if isinstance(n, str) else fn.arg_names[n] for n in fn.do_not_specialize}
    hints = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n, kind in args.items()
        if n not in loose and kind.startswith(("*", "i"))  # pointers and integers, not floats or descriptors
    }
    source = ASTSource(fn=fn, signature=ordered, constexprs=constants, attrs=hints)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def spills(ptx: str, tmp_path: Path) -> tuple[int, int]:
    """ptxas's spill stores and loads in bytes."""
    (tmp_path / "k.ptx").write_text(ptx)
    cmd = [str(PTXAS), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")]
    report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()  # type: ignore[union-attr]
    return int(stores), int(loads)


# the long-prefill attention kernel's tensor and integer arguments (kernels/long_attention.py), as the JIT sees them
LONG_ATTENTION_ARGS = {
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*bf16"),
    **dict.fromkeys(("cu_q_ptr", "cu_k_ptr"), "*i32"),
    "scale_log2": "fp32",
    **dict.fromkeys(("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh"), "i32"),
    **dict.fromkeys(("stride_ot", "stride_oh", "num_seqs", "num_tiles"), "i32"),
}


def compile_long_attention(tiles, group: int, dim: int, tma: bool | None = None):
    """The long-prefill attention kernel for sm_90 with `tiles` (`LongTiles`), `group` query heads a K/V head,
    heads `dim` wide, its blocks by tensor descriptors or pointers (`tma`, default the tiles'), as
    `long_attention` launches it."""
    from omnistage.kernels import long_attention

    tma = tiles.tma if tma is None else tma
    heads = triton.next_power_of_2(group) if tiles.pack else 1
    args = dict(LONG_ATTENTION_ARGS)
    if tma:
        args["q_ptr"] = f"tensordesc<bf16[{tiles.rows // heads}, {heads}, {dim}]>"
        args["k_ptr"] = args["v_ptr"] = f"tensordesc<bf16[{tiles.keys}, 1, {dim}]>"
    constants = {
        **{"GROUP": group, "BLOCK_M": tiles.rows, "BLOCK_N": tiles.keys, "HEAD_DIM": dim},
        **{"HEADS": heads, "TMA": tma},
    }
    return compile_sm90(long_attention._long_attention, args, constants, tiles.warps, tiles.stages)


def swept_long_tiles() -> list:
    """The long-prefill attention kernel's tiles `benchmarks/sdpa_long.py --triton-sweep` times (`LongTiles`)."""
    path = Path(__file__).parents[1] / "benchmarks" / "sdpa_long.py"
    spec = importlib.util.spec_from_file_location("sdpa_long", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TRITON_SWEEP
