"""The samples of one prompt (a request's `n` or `best_of`, fanned out by the server into one request each) are
admitted only where they fit the page pool together: the client is answered once every sample is done, so
samples that could only run one after another would serve it no better than separate requests, while holding
pages that others wait for."""

from __future__ import annotations

from dataclasses import replace

from omnistage.engine.stages.text import TextStage
from omnistage.errors import RequestTooLarge
from omnistage.request import GenerationRequest, ValidRequest


def validate_text(stage: TextStage, request: GenerationRequest) -> ValidRequest:
    """A text request checked against its stage, once. Where it is one of several samples of its prompt, all of
    them must fit the stage's pool at once, each with its prompt and max_tokens (the prompt counted whole for
    each, though the prefix cache may share its pages); without a max_tokens of its own, a sample's default is
    cut to its share of the pool instead."""
    valid = ValidRequest(request, stage.validate(request.prompt_token_ids, request.params))
    samples = request.samples
    if samples == 1:
        return valid
    pool, prompt_len = stage.pool, len(request.prompt_token_ids)
    max_tokens = valid.max_tokens
    if request.params.max_tokens is None:
        max_tokens = min(max_tokens, pool.num_pages // samples * pool.page_size - prompt_len)
        if max_tokens < 1:
            raise RequestTooLarge(
                f"{samples} samples of a prompt of {prompt_len:,} tokens cannot fit the pool of "
                f"{pool.num_pages} pages together; ask for fewer"
            )
    needed = samples * pool.pages_for(prompt_len + max_tokens)
    if needed > pool.num_pages:
        raise RequestTooLarge(
            f"{samples} samples of prompt ({prompt_len:,} tokens) + max_tokens ({max_tokens:,}) need {needed} "
            f"pages together but the pool has {pool.num_pages} pages; ask for fewer samples or fewer tokens"
        )
    return replace(valid, max_tokens=max_tokens)
