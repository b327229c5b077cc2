"""benchmarks/small_gemm.py's patch of `F.linear` onto the GEMV (the kernel's own test: tests/unit/kernels/test_gemv.py),
on the CPU through Triton's interpreter (tests/triton_interpreter.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    import torch
    import torch.nn.functional as F

    SCRIPT = Path(__file__).parents[1] / "benchmarks" / "small_gemm.py"

    @pytest.fixture(scope="module")
    def small_gemm():
        spec = importlib.util.spec_from_file_location("small_gemm", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["small_gemm"] = module
        spec.loader.exec_module(module)
        return module

    def test_linears_under_the_patch_take_the_gemv_for_few_rows_only(small_gemm, monkeypatch):
        calls = []
        gemv = small_gemm.gemv
        monkeypatch.setattr(small_gemm, "gemv", lambda x, w: calls.append(x.shape[0]) or gemv(x, w))
        torch.manual_seed(0)
        layer = torch.nn.Linear(40, 24, bias=False)
        few, many = torch.randn(2, 3, 40), torch.randn(20, 40)  # 6 rows in a batch of sequences; 20 rows
        want_few, want_many = F.linear(few, layer.weight), F.linear(many, layer.weight)
        original = F.linear
        with small_gemm.gemv_projections(max_rows=16):
            got_few, got_many = layer(few), layer(many)
        assert calls == [6]  # the 20-row call stayed on F.linear
        torch.testing.assert_close(got_few, want_few, rtol=1e-5, atol=1e-4)
        assert torch.equal(got_many, want_many)
        assert F.linear is original  # restored after the block
