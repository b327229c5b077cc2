"""`kernels/moe.py` and the Triton alignment kernel of `moe_align.py`, run on the CPU by
Triton's interpreter, against the reference loop `fused_experts` in float32.

Triton picks interpreted or compiled kernels when `triton.language` is first imported, so the kernels
run in a child pytest with TRITON_INTERPRET=1 set from its start (tests/triton_interpreter.py).
Run directly: `TRITON_INTERPRET=1 pytest tests/unit/kernels/test_moe.py`.
"""

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

from omnistage.models.layers.moe_experts import fused_experts

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernels_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    from omnistage.kernels.moe import MoeKernelConfig, default_config, triton_experts
    from omnistage.kernels.moe_align import align_pairs_torch, align_pairs_triton

    def _inputs(num_tokens, hidden, inter, experts, top_k, seed, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
        probs = torch.randn(num_tokens, experts, generator=g).softmax(-1)
        weights, ids = probs.topk(top_k, dim=-1)
        return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids

    def _rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    @pytest.mark.parametrize(
        "num_tokens, hidden, inter, experts, top_k",
        [
            (1, 64, 32, 16, 4),  # one token: most experts get nothing
            (5, 48, 40, 8, 2),  # T, H and I not multiples of the tiles
            (37, 64, 32, 128, 8),  # the released E and k at small H/I
            (1, 32, 16, 128, 8),
            (300, 64, 32, 8, 2),  # many pairs per expert: the 64-row tiles
            (600, 96, 40, 8, 2),  # a prefill chunk's hundreds: the 128-row tiles, wider than H and I
        ],
    )
    def test_matches_loop(num_tokens, hidden, inter, experts, top_k):
        args = _inputs(num_tokens, hidden, inter, experts, top_k, seed=num_tokens + experts)
        out = triton_experts(*args)
        assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
        assert _rel(out, fused_experts(*args)) < 1e-5

    def test_all_pairs_on_two_experts():
        # 20 tokens on expert 2 and expert 3: more pairs than one 16-row block, 6 experts idle.
        x, w13, w2, _, _ = _inputs(20, 32, 16, 8, 1, seed=5)
        ids = torch.tensor([[2, 3]]).expand(20, 2).contiguous()
        weights = torch.tensor([[0.25, 0.75]]).expand(20, 2).contiguous()
        out = triton_experts(x, w13, w2, weights, ids)
        assert _rel(out, fused_experts(x, w13, w2, weights, ids)) < 1e-5

    @pytest.mark.parametrize(
        "config",
        [
            MoeKernelConfig(block_m=16, gate_up_n=16, gate_up_k=16, down_n=16, down_k=16),
            MoeKernelConfig(block_m=32, gate_up_n=32, gate_up_k=32, down_n=64, down_k=16, num_warps=8),
            # a block's N tiles side by side: the grid's axes swapped
            MoeKernelConfig(block_m=16, gate_up_n=16, gate_up_k=16, down_n=32, down_k=16, n_inner=True),
        ],
    )
    @pytest.mark.parametrize("hidden, inter", [(72, 40), (64, 32)])
    def test_explicit_tiles(config, hidden, inter):
        # K loops of several steps; ragged last tiles (72, 40) or tiles that divide H and I (64, 32).
        args = _inputs(13, hidden, inter, 6, 3, seed=7)
        assert _rel(triton_experts(*args, config=config), fused_experts(*args)) < 1e-5

    def test_the_programs_order_leaves_every_tile_the_same():
        # each program computes its own tile: launching a block's N tiles side by side changes no bit
        args = _inputs(40, 72, 40, 6, 3, seed=11)
        config = MoeKernelConfig(block_m=16, gate_up_n=16, gate_up_k=16, down_n=32, down_k=16)
        swapped = MoeKernelConfig(block_m=16, gate_up_n=16, gate_up_k=16, down_n=32, down_k=16, n_inner=True)
        assert torch.equal(triton_experts(*args, config=config), triton_experts(*args, config=swapped))

    def test_float16():
        args = _inputs(9, 64, 32, 8, 2, seed=1, dtype=torch.float16)
        out = triton_experts(*args)
        assert out.dtype == torch.float16
        want = fused_experts(*[a.float() if a.is_floating_point() else a for a in args])
        assert _rel(out, want) < 2e-3

    def test_default_config_by_batch():
        assert default_config(8, 128).block_m == 16
        assert default_config(64 * 8, 128).block_m == 16
        assert default_config(2047 * 8, 128).block_m == 64
        assert default_config(2048 * 8, 128).block_m == 128  # the Thinker's 2,048-token prefill chunk

    @pytest.mark.parametrize(
        "num_tokens, experts, top_k, block_m",
        [(1, 128, 8, 16), (5, 8, 2, 4), (33, 16, 4, 16), (7, 4, 1, 1), (64, 128, 8, 16), (300, 128, 8, 64)],
    )
    def test_align_kernel_equals_torch(num_tokens, experts, top_k, block_m):
        g = torch.Generator().manual_seed(num_tokens)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
        flat = ids.reshape(-1).to(torch.int32)
        want, got = align_pairs_torch(flat, experts, block_m), align_pairs_triton(flat, experts, block_m)
        assert torch.equal(got.pair_ids, want.pair_ids)
        assert torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.expert_ends, want.expert_ends)
