"""The one-row GEMV kernel (kernels/gemv.py) on the CPU through Triton's interpreter, and `GemvLinear`
and `adopt_gemv` off CUDA: the product of `F.linear` for any row count and widths that are not multiples of the
blocks; on a CPU nothing is adopted and a GemvLinear is a Linear."""

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

    def test_off_cuda_nothing_is_adopted_and_a_gemv_linear_is_a_linear():
        from omnistage.models.layers.linear import GemvLinear, adopt_gemv

        model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False), torch.nn.ReLU())
        assert adopt_gemv(model) == [] and type(model[0]) is torch.nn.Linear
        layer = GemvLinear(32, 16, bias=False)
        x = torch.randn(1, 32)
        assert torch.equal(layer(x), F.linear(x, layer.weight))

else:
    patch_interpreter()

    from omnistage.kernels.gemv import gemv

    @pytest.mark.parametrize("rows", [1, 3, 4, 5])
    @pytest.mark.parametrize("block_n", [8, 32])
    def test_gemv_is_the_linear_product(rows, block_n):
        torch.manual_seed(rows * 100 + block_n)
        out_features, in_features = 70, 300  # neither a multiple of the blocks
        weight = torch.randn(out_features, in_features)
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(gemv(x, weight, block_n), F.linear(x, weight), rtol=1e-5, atol=1e-4)

    @pytest.mark.parametrize("config", [(8, 256, 4), (2, 1024, 4), (1, 512, 4), (16, 64, 8)])
    def test_every_one_row_configuration_is_the_linear_product(config):
        """One row accumulates elementwise and reduces once; blocks longer than the row, and a row that is not a
        multiple of the block, are masked."""
        from omnistage.kernels.gemv import one_row_configs

        torch.manual_seed(sum(config))
        weight = torch.randn(70, 300)
        x = torch.randn(1, 300)
        torch.testing.assert_close(gemv(x, weight, *config), F.linear(x, weight), rtol=1e-5, atol=1e-4)
        assert all(block_k <= 512 for _, block_k, _ in one_row_configs(300))
