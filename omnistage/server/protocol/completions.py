"""`/v1/completions`' request: raw prompts, each text or token ids, and OpenAI's completion-only fields (echo,
logprobs in the legacy shape, best_of)."""

from __future__ import annotations

from typing import Annotated, Any, cast

from pydantic import Discriminator, Field, Tag

from omnistage.server.errors import InvalidField
from omnistage.server.protocol.base import (
    Int64,
    SamplingRequest,
    TokenId,
    empty,
    samples_bound,
    unless,
    within_samples,
)

# OpenAI's bound of the legacy logprobs.
MAX_COMPLETION_LOGPROBS = 5


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return (
        "list[str]"
        if isinstance(first, str)
        else "list[list[int]]"
        if isinstance(first, list)
        else "list[int]"
    )


# Tagged by the JSON shape, so a bad element is reported once, at its index (the tags are left out of paths).
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[TokenId], Tag("list[int]")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, token ids, or a list of either",
    ),
]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    echo: bool | None = None  # the prompt's text before the reply
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] = None
    best_of: Annotated[Int64 | None, unless(within_samples, samples_bound("best_of"))] = None
    suffix: Annotated[str | None, unless(empty, "suffix is not supported")] = None

    def requested_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise InvalidField(
                "echo",
                "echo with logprobs asks for the prompt's logprobs, which this server does not compute; ask for "
                "one or the other",
            )
        return self.logprobs

    def samples(self) -> int:
        """How many samples each prompt gets: `best_of`, of which the `n` most likely are returned, else `n`.
        Raises InvalidField where best_of cannot be honoured."""
        if self.best_of is None or self.best_of == self.choices:
            return self.choices
        if self.best_of < self.choices:
            raise InvalidField("best_of", f"must be at least n ({self.choices}), got {self.best_of}")
        if self.stream:
            raise InvalidField(
                "best_of", "cannot be streamed: the best samples are known only once all are done"
            )
        return self.best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each as text or token ids; an empty one is a 400 naming it."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], str | list):
            if not prompt:
                raise InvalidField("prompt", "must not be empty")
            return [cast("str | list[int]", prompt)]  # one prompt: a str or a list of ids
        given = cast("list[str] | list[list[int]]", prompt)
        empty_at = next((i for i, p in enumerate(given) if not p), None)
        if empty_at is not None:
            raise InvalidField(f"prompt[{empty_at}]", "must not be empty")
        return list(given)
