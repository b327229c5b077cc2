"""The long-prefill attention kernel (`kernels/long_attention.py`) compiled for an H100/H200 (sm_90) on the CPU,
as the JIT compiles it there (tests/sm90.py), with its default tiles for the released Qwen3-Omni's head layouts,
its blocks by tensor descriptors and by pointers: its products on Hopper's warpgroup tensor cores, its loads
bulk tensor copies (descriptors) or software-pipelined asynchronous copies (pointers), no register spilled, its
shared memory within the SM's. Needs Triton's ahead-of-time compiler and its wheel's ptxas; skipped where either is
missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton.compiler")

from sm90 import PTXAS, SHARED_BYTES, compile_sm90, spills  # noqa: E402

from omnistage.kernels import long_attention  # noqa: E402

ARGS = {
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*bf16"),
    **dict.fromkeys(("cu_q_ptr", "cu_k_ptr"), "*i32"),
    "scale_log2": "fp32",
    **dict.fromkeys(("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh"), "i32"),
    **dict.fromkeys(("stride_ot", "stride_oh", "num_seqs", "num_tiles"), "i32"),
}
LAYOUTS = {"thinker": (32, 4, 128), "talker": (16, 2, 128)}  # query heads, K/V heads, head dim


def _sweep() -> list[long_attention.LongTiles]:
    """The tiles `benchmarks/sdpa_long.py --triton-sweep` times."""
    path = Path(__file__).parents[3] / "benchmarks" / "sdpa_long.py"
    spec = importlib.util.spec_from_file_location("sdpa_long", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TRITON_SWEEP


def _compile(tiles: long_attention.LongTiles, heads: int, kv_heads: int, dim: int, tma: bool):
    constants = {
        **{"GROUP": heads // kv_heads, "BLOCK_M": tiles.rows, "BLOCK_N": tiles.keys},
        **{"HEAD_DIM": dim, "TMA": tma},
    }
    args = dict(ARGS)
    if tma:
        args["q_ptr"] = f"tensordesc<bf16[{tiles.rows}, 1, {dim}]>"
        args["k_ptr"] = args["v_ptr"] = f"tensordesc<bf16[{tiles.keys}, 1, {dim}]>"
    return compile_sm90(long_attention._long_attention, args, constants, tiles.warps, tiles.stages)


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_default_tiles_compile_to_warpgroup_products_pipelined_without_spills(stage, tma, tmp_path):
    heads, kv_heads, dim = LAYOUTS[stage]
    tiles = long_attention.LONG_TILES
    assert tiles.tma  # the default; the pointers' variant is the kernel's fallback for unaligned views
    kernel = _compile(tiles, heads, kv_heads, dim, tma)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "its products are not on the warpgroup tensor cores"
    if tma:
        assert "cp.async.bulk.tensor" in ptx, "its blocks are not bulk tensor copies"
    else:
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], "its loads are not pipelined"
    assert kernel.metadata.shared <= SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"
    assert spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"it spills registers ({tiles})"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")
@pytest.mark.parametrize("tiles", _sweep(), ids=str)
def test_every_swept_tile_compiles_without_spills(tiles, tmp_path):
    kernel = _compile(tiles, *LAYOUTS["thinker"], tiles.tma)
    assert kernel.metadata.shared <= SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"
    assert spills(kernel.asm["ptx"], tmp_path) == (0, 0), f"it spills registers ({tiles})"
