"""Counts that vary from step to step build no new Triton kernel: the MoE kernels, their alignment and paged
attention are built once per tile configuration, whatever the token count or the block table's width, and the
compile watch sees every build that does happen."""

import pytest
import torch

from omnistage.engine.attention import AttentionMetadata
from omnistage.engine.compile_watch import watch_compiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def _experts(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    from omnistage.kernels.moe import triton_experts

    g = torch.Generator(device=DEV).manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g, device=DEV).bfloat16()
    topk_weights, topk_ids = torch.randn(num_tokens, EXPERTS, generator=g, device=DEV).softmax(-1).topk(TOP_K)
    return triton_experts(x, w13, w2, topk_weights, topk_ids)


def _built(watch, before: int, name: str) -> list[str]:
    return [what for what, _ in watch.builds[before:] if name in what]


def test_moe_kernels_build_once_per_tile_configuration_whatever_the_token_count():
    watch = watch_compiles()
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV).bfloat16()
    # one count per tile configuration first (16-, 32- and 64-row blocks), then counts of every class:
    # odd, even, divisible by 16, one
    for first in (3, 200, 600):
        _experts(first, w13, w2)
    torch.cuda.synchronize()
    before = len(watch.builds)
    for num_tokens in (1, 2, 16, 17, 64, 129, 257, 512, 601, 640, 1001, 1024):
        _experts(num_tokens, w13, w2)
    torch.cuda.synchronize()
    assert _built(watch, before, "kernel") == []


def test_paged_attention_builds_once_whatever_the_block_tables_width():
    from omnistage.kernels.attention import paged_attention, write_kv

    watch = watch_compiles()
    cache = torch.randn(2, 512, 16, 4, 128, device=DEV).bfloat16()

    def prefill(tokens: list[int]) -> torch.Tensor:
        pages = iter(range(512))
        chunks = [(0, n, [next(pages) for _ in range(-(-n // 16))]) for n in tokens]
        meta = AttentionMetadata.build(chunks, 16, device=DEV)
        rows = sum(tokens)
        q = torch.randn(rows, 32, 128, device=DEV).bfloat16()
        k, v = torch.randn(2, rows, 4, 128, device=DEV).bfloat16()
        write_kv(cache, k, v, meta.slot_mapping)
        return paged_attention(q, cache, meta, 128**-0.5)

    prefill([40, 33])  # three pages wide
    torch.cuda.synchronize()
    before = len(watch.builds)
    for tokens in ([5, 9], [256, 3], [250, 17], [512], [100, 100, 100]):  # widths 1, 16, 16, 32, 7
        assert not prefill(tokens).isnan().any()
    torch.cuda.synchronize()
    assert _built(watch, before, "_paged_attention") == []


def test_the_watch_sees_a_kernel_built_for_a_new_configuration():
    watch = watch_compiles()
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV).bfloat16()
    from omnistage.kernels.moe import MoeKernelConfig, triton_experts

    before = len(watch.builds)
    x = torch.randn(8, HIDDEN, device=DEV).bfloat16()
    topk_weights, topk_ids = torch.randn(8, EXPERTS, device=DEV).softmax(-1).topk(TOP_K)
    odd = MoeKernelConfig(
        block_m=16, gate_up_n=16, gate_up_k=32, down_n=16, down_k=32, num_warps=2, num_stages=2
    )
    triton_experts(x, w13, w2, topk_weights, topk_ids, config=odd)
    torch.cuda.synchronize()
    built = _built(watch, before, "_gate_up_kernel")
    assert len(built) == 1 and "num_warps=2" in built[0]
