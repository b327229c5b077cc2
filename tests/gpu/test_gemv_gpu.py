"""The one-row GEMV (kernels/gemv.py) against cuBLAS at the speech stages' shapes, `adopt_gemv`'s swap of
the projections it measures faster, and a `GemvLinear` in a region compiled with dynamic shapes and replayed in a
captured CUDA graph."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.gemv import gemv, one_row_configs
from omnistage.models.layers.linear import GemvLinear, adopt_gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"


@pytest.mark.parametrize(("out_features", "in_features"), [(1024, 2048), (1024, 768), (4096, 1024)])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_is_the_linear_product(out_features, in_features, rows):
    g = torch.Generator(device=DEV).manual_seed(rows)
    weight = torch.randn(out_features, in_features, device=DEV, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, device=DEV, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(gemv(x, weight).float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize(("out_features", "in_features"), [(1024, 2048), (1024, 3072), (6144, 1024)])
def test_every_one_row_configuration_is_the_linear_product(out_features, in_features):
    g = torch.Generator(device=DEV).manual_seed(in_features)
    weight = torch.randn(out_features, in_features, device=DEV, generator=g).to(torch.bfloat16)
    x = torch.randn(1, in_features, device=DEV, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float())
    for config in one_row_configs(in_features):
        torch.testing.assert_close(
            gemv(x, weight, *config).float(), want, rtol=2e-2, atol=5e-2, msg=str(config)
        )


class Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o_proj = nn.Linear(2048, 1024, bias=False)  # the Talker's and code predictor's: cuBLAS is slow
        self.qkv = nn.Linear(1024, 4096, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(self.o_proj(x))


def test_adopted_projections_keep_their_weights_and_their_product():
    model = Projections().to(DEV, torch.bfloat16).requires_grad_(False)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    x = torch.randn(1, 1, 2048, device=DEV, dtype=torch.bfloat16)
    want = model(x).float()
    adopted = adopt_gemv(model)
    assert set(adopted) <= {"o_proj", "qkv"}
    for name in adopted:
        assert isinstance(model.get_submodule(name), GemvLinear)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights
    torch.testing.assert_close(model(x).float(), want, rtol=2e-2, atol=5e-2)
    many = torch.randn(3, 2048, device=DEV, dtype=torch.bfloat16)  # not one row: cuBLAS, as before
    assert torch.equal(model.o_proj(many), F.linear(many, model.o_proj.weight))


def test_projections_fused_into_a_larger_gemm_are_left_alone():
    from omnistage.models.layers.linear import fuse_linears

    model = nn.ModuleDict({"a": nn.Linear(2048, 1024, bias=False), "b": nn.Linear(2048, 1024, bias=False)})
    model = model.to(DEV, torch.bfloat16).requires_grad_(False)
    fuse_linears(
        model["a"], model["b"]
    )  # as q/k/v are: called as one GEMM over the fused weight, never alone
    assert adopt_gemv(model) == []


def test_a_fused_projection_takes_the_gemv_where_it_is_faster_and_keeps_its_product():
    """The code predictor's MLP (gate/up fused, 1,024 to 2 x 3,072): its fused GEMM is timed as a shape of its
    own; whichever wins, one row gives cuBLAS's product within bf16 tolerance, compiled and in a graph."""
    from omnistage.models.layers.moe import GatedMLP

    mlp = GatedMLP(1024, 3072).to(DEV, torch.bfloat16).requires_grad_(False)
    mlp.fuse_projections()
    x = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
    want = mlp(x).float()
    adopted = adopt_gemv(mlp)
    assert set(adopted) <= {"gate_up", "down_proj"}
    assert (mlp.gate_up.gemv_config is not None) == ("gate_up" in adopted)
    compiled = torch.compile(mlp, dynamic=True)
    compiled(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x)
    graph.replay()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=5e-2)


def test_a_compiled_gemv_linear_replays_in_a_graph():
    layer = GemvLinear(2048, 1024, bias=False, device=DEV, dtype=torch.bfloat16).requires_grad_(False)
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for rows in (1, 4):
        x = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16)
        eager = layer(x)
        compiled(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x)
        graph.replay()
        assert torch.equal(out, eager)
