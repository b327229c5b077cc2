"""The compiled routing kernel (kernels/moe_router.py) at the Thinker's sizes against the torch path
(`moe.route_torch`): alone, through `SparseMoeBlock.route`, and in a region compiled with dynamic shapes and
replayed in a captured CUDA graph."""

import pytest
import torch
from routing_oracle import assert_routes_alike, lower_ids_first

from omnistage.models.layers import moe
from omnistage.models.layers.moe import SparseMoeBlock, route_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
EXPERTS, TOP_K, HIDDEN = 128, 8, 2048  # the released Thinker's router


def distinct_bf16_logits(num_tokens, seed):
    """Rows of bf16 logits, each a shuffle of 128 distinct values, so that torch.topk has no tie to break."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    order = torch.rand(num_tokens, EXPERTS, generator=g, device=DEV).argsort(dim=-1)
    return ((order - EXPERTS // 2) * 2**-4).bfloat16()


@pytest.mark.parametrize("num_tokens", [1, 7, 32, 300, 4096])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_kernel_routes_as_the_torch_path(num_tokens, renormalize):
    from omnistage.kernels.moe_router import route_topk

    g = torch.Generator(device=DEV).manual_seed(num_tokens)
    cases = {
        torch.float32: torch.randn(num_tokens, EXPERTS, generator=g, device=DEV) * 2,
        torch.bfloat16: distinct_bf16_logits(num_tokens, seed=num_tokens),
    }
    for dtype, logits in cases.items():
        got = route_topk(logits, TOP_K, renormalize, dtype)
        assert_routes_alike(got, route_torch(logits, TOP_K, renormalize, dtype))


def test_ties_go_to_the_lower_ids():
    from omnistage.kernels.moe_router import route_topk

    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randint(-3, 4, (64, EXPERTS), generator=g, device=DEV).bfloat16()
    got = route_topk(logits, TOP_K, True, torch.bfloat16)
    assert_routes_alike(got, lower_ids_first(logits, TOP_K, True, torch.bfloat16))


@pytest.fixture(scope="module")
def block():
    """A bf16 block whose router weights are -1, 0 or 1: with `hidden_states` the logits are integers of at
    most 16, exact whatever the GEMM's algorithm and reduction precision, so eager, compiled and replayed
    logits are the same bits (and tie often)."""
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, 64).to(DEV, torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randint(-1, 2, (EXPERTS, HIDDEN), generator=g, device=DEV))
    return block


def hidden_states(num_tokens, seed):
    """16 entries of each row ±1, the rest 0."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    cols = torch.rand(num_tokens, HIDDEN, generator=g, device=DEV).argsort(dim=-1)[:, :16]
    signs = torch.randint(0, 2, (num_tokens, 16), generator=g, device=DEV) * 2 - 1
    return torch.zeros(num_tokens, HIDDEN, device=DEV).scatter_(1, cols, signs.float()).bfloat16()


@torch.no_grad()
def test_the_block_routes_on_cuda_with_the_kernel(block, monkeypatch):
    def no_torch_path(*args):
        raise AssertionError("route took the torch path on CUDA")

    monkeypatch.setattr(moe, "route_torch", no_torch_path)
    x = hidden_states(32, seed=1)
    assert_routes_alike(block.route(x), lower_ids_first(block.gate(x), TOP_K, True, torch.bfloat16))


@torch.no_grad()
@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_compiled_and_replayed_in_a_graph(block, num_tokens):
    route = torch.compile(block.route, fullgraph=True, dynamic=True)
    static_x = hidden_states(num_tokens, seed=0)
    route(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route(static_x)
    for seed in (1, 2):
        x = hidden_states(num_tokens, seed)
        static_x.copy_(x)
        graph.replay()
        eager = block.route(x)
        assert torch.equal(weights, eager[0]) and torch.equal(ids, eager[1])  # the same kernel, bit for bit
        assert_routes_alike((weights, ids), lower_ids_first(block.gate(x), TOP_K, True, torch.bfloat16))
