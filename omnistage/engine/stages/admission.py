"""A text stage's admission, before anything is queued: a request checked against the model's context, its
vocabulary and the page pool (`max_tokens_for`), and the media of several requests through the encoders
together (`encode_media`), a failure failing only the request at fault."""

from __future__ import annotations

from collections.abc import Mapping

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.stages.encoders import EncoderStage, MultimodalEmbeds
from omnistage.errors import InvalidRequest, RequestTooLarge
from omnistage.request import GenerationRequest, SamplingParams


def max_tokens_for(
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    pool: PagePool,
    max_tokens_default: int | None,
) -> int:
    """The request's effective max_tokens: its own, else `max_tokens_default` within what the context and the
    whole pool allow; raises what makes it unservable."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty")
    prompt_len = len(prompt_token_ids)
    if prompt_len >= max_model_len:  # before the scan below, which a huge prompt would make slow
        raise RequestTooLarge(
            f"the prompt has {prompt_len:,} tokens; the model's context is {max_model_len:,} tokens"
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary of {vocab_size}")
    bad = next((t for t in params.logit_bias or {} if t >= vocab_size), None)
    if bad is not None:
        refused = InvalidRequest(f"logit_bias: token id {bad} is outside the vocabulary of {vocab_size}")
        refused.field = "logit_bias"
        raise refused
    if params.max_tokens is None:  # the configured default, within what the context and the whole pool allow
        max_tokens = min(max_model_len, pool.num_pages * pool.page_size) - prompt_len
        if max_tokens < 1:
            pool.check_admissible(prompt_len + 1)
        if max_tokens_default is not None:
            max_tokens = min(max_tokens, max_tokens_default)
    else:
        max_tokens = params.max_tokens
    if prompt_len + max_tokens > max_model_len:
        raise RequestTooLarge(
            f"prompt ({prompt_len:,} tokens) + max_tokens ({max_tokens:,}) = {prompt_len + max_tokens:,} "
            f"tokens exceeds the model's context of {max_model_len:,} tokens"
        )
    pool.check_admissible(prompt_len + max_tokens)
    return max_tokens


def encode_media(
    encoders: EncoderStage, requests: Mapping[int, GenerationRequest]
) -> dict[int, MultimodalEmbeds | Exception]:
    """Encoder outputs per index of the requests with media, all in one call; when that call fails, one
    request at a time, so that only the request at fault fails."""
    media = {i: (r.prompt_token_ids, r.mm) for i, r in requests.items() if r.mm is not None}
    if not media:
        return {}
    try:
        return dict(zip(media, encoders.encode_many(list(media.values()))))
    except Exception as exc:
        if len(media) == 1:
            return {i: exc for i in media}
    results: dict[int, MultimodalEmbeds | Exception] = {}
    for i, (token_ids, mm) in media.items():
        try:
            results[i] = encoders.encode(token_ids, mm)
        except Exception as exc:
            results[i] = exc
    return results
