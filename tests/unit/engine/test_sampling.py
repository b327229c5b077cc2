import math

import pytest
import torch

from omnistage.engine.sampling import (
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    make_generator,
)
from omnistage.errors import InvalidRequest
from omnistage.request import SamplingParams

VOCAB = 64


def row(params: SamplingParams | None = None, tokens=(), output=(), eos=(), generator=None) -> SamplingRow:
    params = params or SamplingParams()
    return SamplingRow(params, list(tokens), list(output), generator, list(eos))


def seeded(params: SamplingParams) -> SamplingRow:
    return row(params, generator=make_generator(params, "cpu"))


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """n independent samples from one row of logits, as one batch of n identical unseeded rows."""
    return Sampler()(logits.expand(n, -1).clone(), [row(params) for _ in range(n)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 2}, "n must be 1 (only one choice per request is supported), got 2"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens (5) must not exceed max_tokens (3)"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": math.nan}, "temperature must be >= 0, got nan"),
        ({"temperature": math.inf}, "temperature must be finite, got inf"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= 1, or 0 or -1 to disable it, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0 and finite, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"stop": ["ok", ""]}, "stop must hold only non-empty strings, got ['ok', '']"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids must be non-negative token ids, got [5, -1]"),
    ],
)
def test_validate_messages(kwargs, message):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (
        1,
        16,
        1.0,
        1.0,
        0,
    )
    assert params.stop == [] and params.stop_token_ids == [] and not params.greedy
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    assert make_generator(SamplingParams(), "cpu") is None
    assert make_generator(SamplingParams(seed=-7), "cpu") is not None


def test_greedy_is_argmax_and_leaves_input_alone():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    tokens = Sampler()(logits, [row(params, tokens=[1, 2], output=[2]) for _ in range(5)])
    assert tokens.dtype == torch.long
    assert torch.equal(logits, before)
    assert torch.equal(tokens, apply_penalties(logits, [row(params, [1, 2], [2])] * 5).argmax(-1))
    assert torch.equal(Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 5), logits.argmax(-1))


def test_top_k_one_is_greedy():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(top_k=1, temperature=1.5)) for _ in range(8)]
    for _ in range(20):
        assert torch.equal(Sampler()(logits, rows), logits.argmax(-1))


def run_seeded(logits_steps: list[torch.Tensor], index: int, rows: list[SamplingRow]) -> list[int]:
    return [Sampler()(step, rows)[index].item() for step in logits_steps]


def test_seeded_rows_reproduce_regardless_of_neighbours():
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(seed=1234, temperature=1.0, top_p=0.95)
    target = torch.randn(30, VOCAB, generator=gen)  # one logits row per step
    noise = torch.randn(30, 6, VOCAB, generator=gen)

    alone = run_seeded([t[None] for t in target], 0, [seeded(params)])
    again = run_seeded([t[None] for t in target], 0, [seeded(params)])
    neighbours = [
        row(SamplingParams(temperature=0.0)),
        seeded(SamplingParams(seed=99, top_k=5)),
        row(SamplingParams(temperature=0.7, min_p=0.1)),
    ]
    steps = [torch.cat([noise[s, :2], target[s, None], noise[s, 2:3]]) for s in range(30)]
    in_batch = run_seeded(steps, 2, [neighbours[0], neighbours[1], seeded(params), neighbours[2]])
    assert alone == again == in_batch


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB)
    sequences = {tuple(run_seeded([logits] * 20, 0, [seeded(SamplingParams(seed=s))])) for s in range(5)}
    assert len(sequences) == 5


def allowed_top_k(logits: torch.Tensor, k: int) -> set[int]:
    return set(logits.double().topk(k).indices.tolist())


def allowed_top_p(logits: torch.Tensor, p: float) -> set[int]:
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token].item()
        if mass >= p:
            return kept
    return kept


def allowed_min_p(logits: torch.Tensor, min_p: float) -> set[int]:
    probs = logits.double().softmax(-1)
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=5), lambda lg: allowed_top_k(lg, 5)),
        (SamplingParams(top_p=0.6), lambda lg: allowed_top_p(lg, 0.6)),
        (SamplingParams(min_p=0.2), lambda lg: allowed_min_p(lg, 0.2)),
        (SamplingParams(top_k=10, top_p=0.5, temperature=2.0), None),
    ],
)
def test_truncation_stays_in_allowed_set(params, allowed):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    if allowed is None:  # top-k then top-p, on temperature-scaled logits
        scaled = logits / 2.0
        head = sorted(allowed_top_k(scaled, 10))
        allowed_set = {head[i] for i in allowed_top_p(scaled[head], 0.5)}
    else:
        allowed_set = allowed(logits)
    assert 1 < len(allowed_set) < VOCAB
    seen = set(draws(logits, params).tolist())
    assert seen == allowed_set


def test_mixed_batch_applies_each_rows_own_parameters():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    params = [
        SamplingParams(top_k=3),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3),
    ]
    allowed = [
        allowed_top_k(logits[0], 3),
        {logits[1].argmax().item()},
        allowed_top_p(logits[2], 0.5),
        allowed_min_p(logits[3], 0.3),
    ]
    n = 1000
    batch = logits.repeat(n, 1)
    tokens = Sampler()(batch, [row(params[i % 4]) for i in range(4 * n)]).view(n, 4)
    for i in range(4):
        assert set(tokens[:, i].tolist()) == allowed[i]


def test_one_sampler_follows_each_steps_settings():
    """The settings of one step are kept for the next only while every row's are the same."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    n = 1000
    batch = logits.repeat(n, 1)
    steps = [
        [SamplingParams(top_k=1)] * 4,
        [SamplingParams(top_k=3)] * 4,
        [SamplingParams(top_k=3)] * 4,
        [
            SamplingParams(top_k=3),
            SamplingParams(temperature=0.0),
            SamplingParams(min_p=0.3),
            SamplingParams(top_p=0.5),
        ],
        [SamplingParams(top_p=0.5)] * 4,
    ]
    sampler = Sampler()
    for params in steps:
        tokens = sampler(batch, [row(params[i % 4]) for i in range(4 * n)]).view(n, 4)
        for i, p in enumerate(params):
            if p.greedy:
                allowed = {logits[i].argmax().item()}
            elif p.top_k:
                allowed = allowed_top_k(logits[i], p.top_k)
            elif p.min_p:
                allowed = allowed_min_p(logits[i], p.min_p)
            else:
                allowed = allowed_top_p(logits[i], p.top_p)
            assert set(tokens[:, i].tolist()) == allowed, (params, i)
    # a kept sampler draws what a new one draws from the same seed
    params = SamplingParams(seed=7, temperature=0.8, top_k=20)
    kept, fresh = seeded(params), seeded(params)
    assert [sampler(logits[:1], [kept]).item() for _ in range(5)] == [
        Sampler()(logits[:1], [fresh]).item() for _ in range(5)
    ]


def test_repetition_penalty_reads_the_prompt_and_the_output_together():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0)
    joined = apply_penalties(logits, [row(params, tokens=[0, 1, 1, 4], output=[4])])
    apart = apply_penalties(logits, [row(params, tokens=[0, 1, 1], output=[4])])  # as the engine passes them
    assert torch.equal(apart, joined)
    assert torch.equal(apart[0], torch.tensor([1.0, -4.0, 1.0, -1.0, 0.25]))
    # ids outside the vocabulary count for nothing
    assert torch.equal(apply_penalties(logits, [row(params, tokens=[0, 1, 99], output=[4, 7])]), joined)


def test_samples_follow_softmax_and_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        counts = torch.bincount(draws(logits, SamplingParams(temperature=temperature), n), minlength=6)
        expected = (logits / temperature).softmax(-1)
        assert torch.allclose(counts / n, expected, atol=0.015), temperature
    top = [
        (draws(logits, SamplingParams(temperature=t), n) == 0).float().mean().item() for t in (0.5, 1.0, 2.0)
    ]
    assert top[0] > top[1] > top[2]


def test_repetition_penalty_formula():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    rows = [row(SamplingParams(repetition_penalty=2.0), tokens=[0, 1, 1, 4], output=[4]), row()]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[0], torch.tensor([1.0, -4.0, 1.0, -1.0, 0.25]))
    assert torch.equal(out[1], logits[1])
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5]))


def test_presence_and_frequency_penalty_formula():
    logits = torch.zeros(2, 5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt-only token 3 is not penalised: these penalties look at output tokens only.
    rows = [row(SamplingParams()), row(params, tokens=[3, 0, 2, 2, 2], output=[0, 2, 2, 2])]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[0], torch.zeros(5))
    assert torch.allclose(out[1], torch.tensor([-0.75, 0.0, -1.25, 0.0, 0.0]))


def test_all_penalties_compose_repetition_first():
    logits = torch.tensor([[3.0, -3.0, 1.0]])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    out = apply_penalties(logits, [row(params, tokens=[0, 1, 1], output=[1, 1])])
    assert torch.allclose(out[0], torch.tensor([2.0, -4.5 - 1.0 - 1.0, 1.0]))


def test_no_penalties_returns_logits_unchanged():
    logits = torch.randn(2, 5)
    assert apply_penalties(logits, [row(), row(tokens=[1, 2], output=[2])]) is logits


def test_min_tokens_blocks_eos_and_stop_ids():
    eos, stop_id = 7, 9
    logits = torch.zeros(3, VOCAB)
    logits[:, eos] = 50.0
    logits[:, stop_id] = 40.0
    params = SamplingParams(min_tokens=3, stop_token_ids=[stop_id], temperature=0.0)
    rows = [
        row(params, output=[1, 2], eos=[eos]),  # still short: both masked
        row(params, output=[1, 2, 3], eos=[eos]),  # reached min_tokens: eos allowed
        row(SamplingParams(temperature=0.0), eos=[eos]),
    ]
    masked = apply_min_tokens(logits, rows)
    assert masked[0, eos] == -math.inf and masked[0, stop_id] == -math.inf
    assert torch.equal(masked[1:], logits[1:])
    assert Sampler()(logits, rows).tolist()[1:] == [eos, eos]
    sampled_rows = [row(SamplingParams(min_tokens=3, stop_token_ids=[stop_id]), output=[1], eos=[eos])] * 500
    tokens = Sampler()(logits[:1].expand(500, -1), sampled_rows)
    assert not ({eos, stop_id} & set(tokens.tolist()))


def test_ranking_only_the_largest_top_k_equals_sorting_the_whole_vocabulary():
    """When every row has a top_k, only max(top_k) candidates are ranked; the kept logits are the same."""
    from omnistage.engine.sampling import _apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2048, generator=g) * 3
    top_k = torch.tensor([50, 50, 7, 1, 50, 20])
    top_p = torch.tensor([0.8, math.inf, 0.5, 0.9, 0.01, 1.0])
    full = _apply_top_k_top_p(logits, top_k, top_p)
    head = _apply_top_k_top_p(logits, top_k, top_p, head=50)
    assert torch.equal(full, head)
    assert (head > -math.inf).sum(dim=1).tolist()[3] == 1 and (head > -math.inf).sum(dim=1).max() <= 50


def test_logit_bias_forces_a_token_and_its_floor_bans_one():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 5
    forced = int(logits.argmin())
    for temperature in (0.0, 1.0):
        picked = draws(logits, SamplingParams(temperature=temperature, logit_bias={forced: 100.0}), n=500)
        assert picked.unique().tolist() == [forced]
    # the favourite's logit is far above the others': +99 would still leave it drawn now and then, -100 never
    logits[0, 0] = 200.0
    assert (draws(logits, SamplingParams(logit_bias={0: -99.0}), n=2000) == 0).any()
    banned = draws(logits, SamplingParams(logit_bias={0: -100.0}), n=2000)
    assert not (banned == 0).any()
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0, logit_bias={0: -100.0}))]).item() != 0


def test_logit_bias_is_per_row_and_leaves_the_logits_untouched():
    logits = torch.zeros(3, VOCAB)
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={5: 1.0})),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logit_bias={9: 2.0, 5: 1.0})),
    ]
    assert Sampler()(logits, rows).tolist() == [5, 0, 9]
    assert not logits.any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": -1}, "logprobs must be in [0, 20] or None, got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] or None, got 21"),
        ({"logit_bias": {5: 101.0}}, "logit_bias of token 5 must be in [-100, 100], got 101.0"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must map non-negative token ids, got -1"),
        ({"logit_bias": {5: math.nan}}, "logit_bias must be finite, got nan"),
        ({"logit_bias": {5: "x"}}, "logit_bias of token 5 must be a number, got 'x'"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must be an integer in [-2**63, 2**63), got '5'"),
        ({"logit_bias": [5]}, "logit_bias must map token ids to biases, got [5]"),
    ],
)
def test_validate_logprobs_and_logit_bias(kwargs, message):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message
