"""Triton kernels compiled for an H100/H200 (sm_90) on the CPU, as the JIT compiles them there: Triton's
ahead-of-time compiler with the divisibility hints the JIT gives their arguments, and the ptxas its wheel ships.

Compiled without those hints, the same kernels come out unpipelined and may spill: a check that omits them
would mislead.
"""

from __future__ import annotations

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
