"""The long-prefill attention kernel (`kernels/long_attention.py`) as the JIT builds it for an H100/H200 (sm_90),
on any machine with Triton: for each tile `sdpa_long.py --triton-sweep` times, its registers, shared memory,
spills and the instructions its products and loads compile to (warpgroup products, bulk tensor copies,
asynchronous copies). No GPU needed: Triton's compiler and its wheel's ptxas, with the JIT's hints
(tests/sm90.py, which the compile tests use too).

    python3 benchmarks/kernel_build.py            # the Thinker's head layout (32 query heads over 4, 128 wide)
    python3 benchmarks/kernel_build.py --left-out # also the tiles the sweep leaves out, and why
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from sm90 import PTXAS, compile_long_attention, swept_long_tiles  # noqa: E402

from omnistage.kernels import long_attention  # noqa: E402

# tiles the sweep leaves out: with pointers, they spill registers
LEFT_OUT = [
    long_attention.LongTiles(128, 64, 4, 3, tma=False),
    long_attention.LongTiles(128, 128, 8, 3, tma=False),
]


def build(tiles: long_attention.LongTiles, group: int = 8, dim: int = 128) -> dict[str, object]:
    kernel = compile_long_attention(tiles, group, dim)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        cmd = [str(PTXAS), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    spilled = sum(map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()))  # type: ignore[union-attr]
    return {
        "registers": registers,
        "shared_kib": kernel.metadata.shared / 1024,
        "spill_bytes": spilled,
        "warpgroup_products": ptx.count("wgmma.mma_async"),
        "bulk_tensor_copies": ptx.count("cp.async.bulk.tensor"),
        "async_copies": ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
    }


def main() -> None:
    print("| tile (rows x keys, warps, stages, blocks) | registers | shared KiB | spill stores and loads, bytes | wgmma | bulk tensor "
          "copies | async copies |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    extra = LEFT_OUT if "--left-out" in sys.argv[1:] else []
    for tiles in dict.fromkeys((long_attention.LONG_TILES, *swept_long_tiles(), *extra)):
        r = build(tiles)
        name = f"{tiles.rows}x{tiles.keys}, {tiles.warps}, {tiles.stages}, {'descriptors' if tiles.tma else 'pointers'}{', packed' if tiles.pack else ''}"
        print(f"| {name} | {r['registers']} | {r['shared_kib']:.0f} | {r['spill_bytes']} | {r['warpgroup_products']} | "
              f"{r['bulk_tensor_copies']} | {r['async_copies']} |")  # fmt: skip


if __name__ == "__main__":
    main()
