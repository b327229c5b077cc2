"""Graph-safe sampling: hashed noise that depends only on (seed, draw, column), and the sampler over it."""

from __future__ import annotations

import math

import torch

from omnistage.engine.sampling import _apply_top_k_top_p
from omnistage.engine.static_sampling import StaticRows, sample_static, uniform_noise


def test_noise_is_uniform_and_a_function_of_seed_and_draw_only():
    u = uniform_noise(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 9]), 200_000)
    assert 0 < u.min() and u.max() < 1
    assert torch.allclose(u.mean(dim=1), torch.full((3,), 0.5), atol=3e-3)
    assert torch.allclose(u.var(dim=1), torch.full((3,), 1 / 12), atol=2e-3)
    counts = torch.histc(u[0], bins=20, min=0, max=1)
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 beyond ~43.8
    alone = uniform_noise(torch.tensor([7]), torch.tensor([3]), 64)
    batched = uniform_noise(torch.tensor([1, 7, 9]), torch.tensor([0, 3, 1]), 64)
    assert torch.equal(alone[0], batched[1])
    next_draw = uniform_noise(torch.tensor([7]), torch.tensor([4]), 64)
    other_seed = uniform_noise(torch.tensor([8]), torch.tensor([3]), 64)
    assert abs(torch.corrcoef(torch.stack([alone[0], next_draw[0], other_seed[0]]))[0, 1:]).max() < 0.4


def rows_for(n: int, greedy=False, temperature=1.0, top_p=1.0, seed=0) -> StaticRows:
    rows = StaticRows.empty(n, "cpu")
    rows.fill([greedy] * n, [temperature] * n, [top_p] * n, [seed + i for i in range(n)], [0] * n)
    return rows


def test_samples_follow_the_kept_distribution():
    """20,000 draws of one row (each its own draw number): frequencies match softmax over what top-k and top-p
    keep, and nothing outside that set is ever drawn."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 300, generator=g) * 2
    top_k, top_p, temperature = 20, 0.8, 0.7
    kept = _apply_top_k_top_p(logits / temperature, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    expected = kept.softmax(dim=-1)
    rows = rows_for(1, temperature=temperature, top_p=top_p, seed=42)
    draws = torch.stack([sample_static(logits, rows, top_k) for _ in range(20_000)])[:, 0]
    assert rows.draws.item() == 20_000
    counts = torch.bincount(draws, minlength=300).float()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    chi2 = ((counts[support] - 20_000 * expected[support]) ** 2 / (20_000 * expected[support])).sum()
    assert chi2 < 3 * int(support.sum())  # a loose bound: a wrong distribution is off by orders of magnitude


def test_rows_are_independent_of_their_batch_and_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2048, generator=g)
    together = StaticRows.empty(6, "cpu")  # padded: two rows more than the batch
    together.fill(
        [False, True, False, False], [1.0, 0.0, 0.9, 1.3], [0.8, 1.0, 0.5, 1.0], [5, 6, 7, 8], [10, 0, 3, 3]
    )
    both = torch.stack([sample_static(logits, together, 50) for _ in range(15)])
    for i in range(4):
        alone = StaticRows.empty(1, "cpu")
        alone.fill(
            [together.greedy[i].item()], [together.temperature[i].item()], [min(1.0, together.top_p[i].item())],
            [together.seeds[i].item()], [[10, 0, 3, 3][i]],
        )  # fmt: skip
        assert torch.equal(
            torch.stack([sample_static(logits[i : i + 1], alone, 50) for _ in range(15)])[:, 0], both[:, i]
        )
    assert (both[:, 1] == logits[1].argmax()).all()
    assert together.draws[:4].tolist() == [25, 15, 18, 18] and together.draws[4:].tolist() == [0, 0]
    assert not math.isnan(both.float().sum().item())


def test_tied_logits_rank_by_token_id():
    """bf16 logits tie often. Tied logits rank by token id, lower first, so which of them top-k keeps and which
    noise column each one races with is defined (torch.topk leaves both open): with 100 tokens tied for the
    top and k = 50, rank r is the r-th lowest tied id."""
    g = torch.Generator().manual_seed(3)
    batch, vocab, top_k = 8, 256, 50
    logits = torch.randn(batch, vocab, generator=g) - 10
    tied = torch.stack([torch.randperm(vocab, generator=g)[:100].sort().values for _ in range(batch)])
    logits.scatter_(1, tied, 2.0)
    rows = rows_for(batch, temperature=0.8, seed=9)
    seeds, draws = rows.seeds.clone(), rows.draws.clone()
    # equal weights: the race's winner is the rank whose noise is least
    want = tied.gather(1, uniform_noise(seeds, draws, top_k).log().argmax(dim=-1, keepdim=True))[:, 0]
    assert torch.equal(sample_static(logits, rows, top_k), want)
