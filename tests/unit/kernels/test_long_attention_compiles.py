"""The long-prefill attention kernel (`kernels/long_attention.py`) compiled for an H100/H200 (sm_90) on the CPU,
as the JIT compiles it there (tests/sm90.py), with its default tiles for the released Qwen3-Omni's head layouts,
its blocks by tensor descriptors and by pointers: its products on Hopper's warpgroup tensor cores, its loads
bulk tensor copies (descriptors) or software-pipelined asynchronous copies (pointers), no register spilled, its
shared memory within the SM's. Needs Triton's ahead-of-time compiler and its wheel's ptxas; skipped where either is
missing."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.compiler")

from sm90 import PTXAS, SHARED_BYTES, compile_long_attention, spills, swept_long_tiles  # noqa: E402

from omnistage.kernels import long_attention  # noqa: E402

LAYOUTS = {"thinker": (32, 4, 128), "talker": (16, 2, 128)}  # query heads, K/V heads, head dim


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_default_tiles_compile_to_warpgroup_products_pipelined_without_spills(stage, tma, tmp_path):
    heads, kv_heads, dim = LAYOUTS[stage]
    tiles = long_attention.LONG_TILES
    assert tiles.tma  # the default; the pointers' variant is the kernel's fallback for unaligned views
    kernel = compile_long_attention(tiles, heads // kv_heads, dim, tma)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "its products are not on the warpgroup tensor cores"
    if tma:
        assert "cp.async.bulk.tensor" in ptx, "its blocks are not bulk tensor copies"
    else:
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], "its loads are not pipelined"
    assert kernel.metadata.shared <= SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"
    assert spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"it spills registers ({tiles})"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")
@pytest.mark.parametrize("tiles", swept_long_tiles(), ids=str)
def test_every_swept_tile_compiles_without_spills(tiles, tmp_path):
    heads, kv_heads, dim = LAYOUTS["thinker"]
    kernel = compile_long_attention(tiles, heads // kv_heads, dim)
    assert kernel.metadata.shared <= SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"
    assert spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"it spills registers ({tiles})"
