"""The log-probabilities a step's rows ask for: log_softmax of the raw logits, whatever the sampling did."""

import torch

from omnistage.engine.logprobs import step_logprobs
from omnistage.engine.sampling import Sampler, SamplingRow
from omnistage.request import SamplingParams

VOCAB = 64


def row(**kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), [], [])


def test_logprobs_are_log_softmax_of_the_raw_logits_with_the_top_k_in_order():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    raw = logits.clone()
    rows = [
        row(logprobs=5, temperature=0.7, repetition_penalty=1.3, logit_bias={7: 50.0}),
        row(logprobs=0),
        row(logprobs=20, temperature=0.0),
    ]
    rows[0].output_token_ids = [3, 4]
    sampled = Sampler()(logits, rows)
    found = step_logprobs(logits, sampled, rows).per_row(sampled.tolist())
    assert torch.equal(logits, raw)  # the sampler left the model's logits as they were
    expected = torch.log_softmax(raw, dim=-1)
    for i, (token, logprobs) in enumerate(zip(sampled.tolist(), found)):
        assert logprobs.token_id == token
        assert logprobs.logprob == expected[i, token].item()
        k = rows[i].params.logprobs
        assert len(logprobs.top) == k
        order = expected[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in logprobs.top] == order
        assert [lp for _, lp in logprobs.top] == expected[i, order].tolist()
        assert all(a[1] >= b[1] for a, b in zip(logprobs.top, logprobs.top[1:]))
    # the bias made token 7 the draw of row 0, but its logprob is the model's
    assert sampled[0].item() == 7 and found[0].logprob < expected[0].max().item()
    # greedy: the sampled token is the top one
    assert found[2].top[0] == (found[2].token_id, found[2].logprob)


def test_only_the_rows_that_ask_get_logprobs_and_none_ask_costs_nothing():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [row(), row(logprobs=2), row(), row(logprobs=1)]
    sampled = Sampler()(logits, rows)
    step = step_logprobs(logits, sampled, rows)
    assert step.rows == [1, 3] and step.counts == [2, 1]
    found = step.to_host().per_row(sampled.tolist())
    assert found[0] is None and found[2] is None
    expected = torch.log_softmax(logits, dim=-1)
    assert found[1].logprob == expected[1, sampled[1]].item()
    assert found[3].logprob == expected[3, sampled[3]].item()
    assert len(found[1].top) == 2 and len(found[3].top) == 1
    assert step_logprobs(logits, sampled, [row(), row(), row(), row()]) is None
