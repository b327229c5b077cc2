"""`/v1/completions`' request: one raw prompt, text or token ids, and OpenAI's completion-only fields (echo,
logprobs in the legacy shape)."""

from __future__ import annotations

from typing import Annotated, Any, cast

from pydantic import Discriminator, Field, Tag

from omnistage.server.errors import InvalidField
from omnistage.server.protocol.base import Int64, SamplingRequest, TokenId, empty, unless

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
    best_of: Annotated[Int64 | None, unless(lambda b: b == 1, "best_of must be 1, got {value}")] = None
    suffix: Annotated[str | None, unless(empty, "suffix is not supported")] = None

    def requested_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise InvalidField(
                "echo",
                "echo with logprobs asks for the prompt's logprobs, which this server does not compute; ask for "
                "one or the other",
            )
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several is a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidField("prompt", f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise InvalidField("prompt", "must not be empty")
        return cast("str | list[int]", prompt)  # a batch's one prompt is a str or a list of ids
