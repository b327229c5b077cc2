"""A text stage's admission on plain numbers (`engine/stages/admission.py`): what a request may ask for, before
anything is queued."""

import pytest

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.stages.admission import max_tokens_for
from omnistage.errors import InvalidRequest, RequestTooLarge
from omnistage.request import SamplingParams

CONTEXT, VOCAB = 64, 100


def check(
    prompt: list[int], max_tokens: int | None = None, pages: int = 32, default: int | None = None
) -> int:
    return max_tokens_for(
        prompt, SamplingParams(max_tokens=max_tokens), CONTEXT, VOCAB, PagePool(pages, 4), default
    )


def test_a_request_keeps_its_own_max_tokens():
    assert check([1, 2, 3], max_tokens=10) == 10


def test_without_one_it_gets_what_the_context_and_the_pool_leave_within_the_default():
    assert check([1, 2, 3]) == CONTEXT - 3
    assert check([1, 2, 3], pages=8) == 8 * 4 - 3  # the whole pool holds fewer tokens than the context
    assert check([1, 2, 3], default=16) == 16


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "error"),
    [
        ([], None, InvalidRequest),  # empty
        ([1] * CONTEXT, None, RequestTooLarge),  # the prompt alone fills the context
        ([1, VOCAB], None, InvalidRequest),  # an id outside the vocabulary
        ([1, 2], CONTEXT, RequestTooLarge),  # prompt + max_tokens past the context
    ],
)
def test_what_makes_a_request_unservable_is_raised(prompt, max_tokens, error):
    with pytest.raises(error):
        check(prompt, max_tokens)


def test_a_request_the_whole_pool_could_never_hold_is_refused():
    with pytest.raises(RequestTooLarge):
        check([1, 2, 3], max_tokens=20, pages=4)
