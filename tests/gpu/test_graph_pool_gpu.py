"""Graph sets captured into one memory pool share their scratch: the plan prices a device's main-stream pool at
the largest scratch of its sets, not their sum (memory.plan.MAIN_POOL)."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.attention import AttentionMetadata
from omnistage.engine.graphs import DecodeGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20
SCRATCH = 64 * MiB


def _step(weight: torch.Tensor):
    """A step whose only large allocation is a temporary of SCRATCH bytes, freed before it returns."""

    def step(ids, positions, meta):
        hot = weight * (positions[0, :1].float() + meta.seq_lens[:1].float())
        return hot.sum().expand(ids.shape[0]) + ids

    return step


def test_graph_sets_of_one_pool_share_their_scratch():
    device = torch.device("cuda", 0)
    weight = torch.randn(SCRATCH // 4, device=device)
    pool = torch.cuda.graph_pool_handle()
    runners = [
        DecodeGraphs(_step(weight), max_batch=2, max_pages=1, max_seq_len=16, device=device) for _ in range(2)
    ]
    with torch.inference_mode():
        for runner in runners:
            assert runner.capture([1, 2], pool=pool) == [1, 2]
    first, second = (sum(r.graph_bytes.values()) for r in runners)
    assert first >= SCRATCH, first  # the pool grew to hold the first set's temporary
    assert second < SCRATCH // 2, second  # the second set reused it: captured on the same stream
    ids = torch.arange(2, device=device)
    positions = torch.full((3, 2), 3, device=device)
    meta = AttentionMetadata.build([(3, 1, [0]), (3, 1, [0])], 16, device)
    for runner in runners:
        assert torch.allclose(runner.run(ids, positions, meta), _step(weight)(ids, positions, meta))
