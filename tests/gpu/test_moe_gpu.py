"""The Triton MoE kernels and the sort-free alignment on the GPU, at the released Thinker sizes."""

from dataclasses import replace

import pytest
import torch

from omnistage.models.layers.moe_experts import fused_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device=DEV) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device=DEV) / INTER**0.5).bfloat16()
    return w13, w2


@pytest.fixture(scope="module")
def reference(weights):
    """The loop in fp32 on the bf16 weights."""
    w13, w2 = (w.float() for w in weights)
    return lambda x, topk_weights, topk_ids: fused_experts(x.float(), w13, w2, topk_weights, topk_ids)


def _routing(num_tokens, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g, device=DEV).bfloat16()
    probs = torch.randn(num_tokens, EXPERTS, generator=g, device=DEV).softmax(-1)
    topk_weights, topk_ids = probs.topk(TOP_K, dim=-1)
    return x, topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids


# 300 and 1024 tokens: the 32- and 64-row tiles; 2048 and 8192: the 128-row ones (prefill chunks); from 1024·8
# pairs aligned by torch, not the kernel
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 64, 300, 1024, 2048, 8192])
def test_triton_experts_matches_fp32_loop(weights, reference, num_tokens):
    from omnistage.kernels.moe import triton_experts

    w13, w2 = weights
    x, topk_weights, topk_ids = _routing(num_tokens, seed=num_tokens)
    got = triton_experts(x, w13, w2, topk_weights, topk_ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _rel(got, reference(x, topk_weights, topk_ids)) <= 1e-2


@pytest.mark.parametrize("num_tokens", [64, 2048])
def test_a_blocks_n_tiles_side_by_side_change_no_bit(weights, num_tokens):
    from omnistage.kernels.moe import default_config, triton_experts

    w13, w2 = weights
    x, topk_weights, topk_ids = _routing(num_tokens, seed=num_tokens + 1)
    config = default_config(num_tokens * TOP_K, EXPERTS)
    want = triton_experts(x, w13, w2, topk_weights, topk_ids, config=config)
    got = triton_experts(x, w13, w2, topk_weights, topk_ids, config=replace(config, n_inner=True))
    assert torch.equal(got, want)


def test_grouped_experts_matches_fp32_loop(weights, reference):
    from omnistage.models.layers.grouped_moe import grouped_experts

    w13, w2 = weights
    for num_tokens in (1, 32):
        x, topk_weights, topk_ids = _routing(num_tokens, seed=100 + num_tokens)
        want = reference(x, topk_weights, topk_ids)
        assert _rel(grouped_experts(x, w13, w2, topk_weights, topk_ids), want) <= 2e-2


@pytest.mark.parametrize("num_tokens", [1, 64, 600])  # 600·8 pairs: more than align_pairs gives the kernel
@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_align_kernel_equals_torch(num_tokens, block_m):
    from omnistage.kernels.moe_align import align_pairs_torch, align_pairs_triton

    _, _, topk_ids = _routing(num_tokens, seed=7)
    got = align_pairs_triton(topk_ids.reshape(-1), EXPERTS, block_m)
    want = align_pairs_torch(topk_ids.reshape(-1), EXPERTS, block_m)
    assert torch.equal(got.pair_ids, want.pair_ids)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.expert_ends, want.expert_ends)


@pytest.mark.parametrize("impl", ["triton", "grouped"])
def test_graph_replay_equals_eager(weights, impl):
    from omnistage.kernels.moe import triton_experts
    from omnistage.models.layers.grouped_moe import grouped_experts

    experts = triton_experts if impl == "triton" else grouped_experts
    w13, w2 = weights
    for num_tokens in (1, 32):
        static = _routing(num_tokens, seed=0)
        experts(static[0], w13, w2, static[1], static[2])  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(static[0], w13, w2, static[1], static[2])
        for seed in (1, 2):
            fresh = _routing(num_tokens, seed=seed)
            for buf, value in zip(static, fresh):
                buf.copy_(value)
            graph.replay()
            eager = experts(fresh[0], w13, w2, fresh[1], fresh[2])
            # Triton: the same kernels bit for bit; cuBLAS may pick another algorithm under capture.
            if impl == "triton":
                assert torch.equal(out, eager), (num_tokens, seed)
            assert _rel(out, eager) < 1e-3, (impl, num_tokens, seed)
