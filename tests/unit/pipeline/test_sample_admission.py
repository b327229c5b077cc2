"""The samples of one prompt admitted together (pipeline/samples.py), on a page pool of hand-picked size."""

from __future__ import annotations

import pytest

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.stages.admission import max_tokens_for
from omnistage.errors import RequestTooLarge
from omnistage.pipeline.samples import validate_text
from omnistage.request import GenerationRequest, SamplingParams

PROMPT = list(range(10))


class PoolStage:
    """A text stage's validate over a pool of `pages` pages of 16 tokens (a context of 4,096 tokens)."""

    def __init__(self, pages: int) -> None:
        self.pool = PagePool(pages, 16)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return max_tokens_for(prompt_token_ids, params, 4096, 1000, self.pool, None)


def request(samples: int, max_tokens: int | None) -> GenerationRequest:
    return GenerationRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens), samples=samples)


def test_samples_that_fit_together_are_admitted_as_asked():
    stage = PoolStage(8)
    assert validate_text(stage, request(1, 100)).max_tokens == 100
    assert validate_text(stage, request(4, 20)).max_tokens == 20  # 4 x 2 pages of 8


def test_samples_that_cannot_run_together_are_too_large():
    with pytest.raises(RequestTooLarge, match="5 samples .* need 10 pages together but the pool has 8"):
        validate_text(PoolStage(8), request(5, 20))


def test_a_default_max_tokens_is_each_samples_share_of_the_pool():
    assert validate_text(PoolStage(8), request(1, None)).max_tokens == 8 * 16 - 10
    assert validate_text(PoolStage(8), request(4, None)).max_tokens == 2 * 16 - 10
    with pytest.raises(RequestTooLarge, match="16 samples of a prompt of 10 tokens cannot fit"):
        validate_text(PoolStage(8), request(16, None))
