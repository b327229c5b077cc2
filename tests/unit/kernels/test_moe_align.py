import pytest
import torch

from omnistage.kernels.moe_align import align_pairs, max_blocks


def _ids(num_tokens, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])


# 600 tokens of top-8: more pairs than the Triton program takes on a GPU (a prefill chunk's path)
@pytest.mark.parametrize(
    "num_tokens, experts, top_k", [(1, 128, 8), (5, 8, 2), (64, 128, 8), (300, 16, 4), (600, 128, 8)]
)
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_layout(num_tokens, experts, top_k, block_m):
    ids = _ids(num_tokens, experts, top_k, seed=num_tokens + block_m)
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    align = align_pairs(ids, experts, block_m)
    assert align.num_blocks == max_blocks(num_pairs, experts, block_m)
    assert align.pair_ids.shape == (align.num_blocks * block_m,)

    # The real pairs, in row order, are exactly the stable sort by expert.
    real = align.pair_ids[align.pair_ids < num_pairs].long()
    assert torch.equal(real, torch.sort(flat, stable=True).indices)

    # Every block holds one expert's pairs (padding allowed); blocks past the used ones are -1.
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert torch.equal(align.expert_ends.long(), padded.cumsum(0))
    used = int(padded.sum()) // block_m
    assert (align.block_expert[used:] == -1).all()
    rows = align.pair_ids[: used * block_m].view(used, block_m)
    for block, expert in enumerate(align.block_expert[:used].tolist()):
        pairs = rows[block][rows[block] < num_pairs].long()
        assert len(pairs) > 0 and (flat[pairs] == expert).all()
    assert (align.pair_ids[used * block_m :] == num_pairs).all()


def test_one_row_blocks_are_group_offsets():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    align = align_pairs(ids, 5, block_m=1)
    assert align.pair_ids.tolist() == [1, 4, 3, 0, 2, 5]
    assert align.expert_ends.tolist() == [2, 3, 3, 6, 6]
    assert align.block_expert.tolist() == [0, 0, 1, 3, 3, 3]
