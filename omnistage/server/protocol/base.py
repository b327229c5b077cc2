"""What every request of the protocol shares: strict pydantic models, fields refused unless harmless, integers
within int64, and the sampling fields of chat and text completions (vLLM's names beside OpenAI's, OpenAI's
logit_bias with its token ids as strings)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from omnistage.errors import InvalidRequest
from omnistage.request import SamplingParams
from omnistage.server.errors import InvalidField

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Open(Strict):
    """An object OpenAI keeps adding optional keys to (image_url.detail, prompt_cache_breakpoint, ...):
    those are accepted and ignored; the known keys are still strictly typed."""

    model_config = ConfigDict(extra="allow")


def unless(harmless: Callable[[Any], bool], reason: str) -> AfterValidator:
    """A field this server cannot honour: refused with `reason` (formatted with the value) unless the value
    the client sent changes nothing."""

    def check(value: Any) -> Any:
        if value is not None and not harmless(value):
            raise ValueError(reason.format(value=value))
        return value

    return AfterValidator(check)


def empty(value: Any) -> bool:
    return not value


def never(value: Any) -> bool:
    return False


# The most samples (`n`, `best_of`) one prompt of a request is fanned out into: each is an engine request of its
# own, and a request is admitted only where all of its samples fit the page pool together.
MAX_SAMPLES = 16


def within_samples(value: int) -> bool:
    return 1 <= value <= MAX_SAMPLES


def samples_bound(name: str) -> str:
    """The refusal of a count of samples out of bounds, for `unless`."""
    return f"{name} must be between 1 and {MAX_SAMPLES}, got {{value}}"


class StreamOptions(Strict):
    include_usage: bool | None = False
    # OpenAI pads stream chunks against length side channels; this server sends no padding either way.
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, the usage so far on every chunk


class SamplingExtras(Strict):
    """The sampling fields beyond temperature and top_p that chat, completions and responses all take (OpenAI's
    seed, stop and penalties; vLLM's extras, which clients send through the SDK's extra_body)."""

    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


class SamplingRequest(SamplingExtras):
    """Fields shared by chat and text completions."""

    model: str
    n: Annotated[Int64 | None, unless(within_samples, samples_bound("n"))] = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token ids (as JSON keys: strings) to biases in [-100, 100]
    user: str | None = None  # OpenAI's end-user tag: ignored
    store: bool | None = None  # ignored: nothing is stored (chat's field; clients send it to completions too)

    def sampling_params(self, max_tokens: int | None, max_tokens_field: str = "max_tokens") -> SamplingParams:
        """The engine's SamplingParams; unset fields take the engine's defaults. Raises InvalidField naming the
        field at fault (`max_tokens_field` for max_tokens, the request's name of it)."""
        names = (
            "temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
            "repetition_penalty min_tokens ignore_eos skip_special_tokens include_stop_str_in_output"
        ).split()
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.logit_bias:
            values["logit_bias"] = _token_ids_of(self.logit_bias)
        if (logprobs := self.requested_logprobs()) is not None:
            values["logprobs"] = logprobs
        try:
            base = SamplingParams(max_tokens=max_tokens)
        except InvalidRequest as exc:
            raise InvalidField(max_tokens_field, str(exc)) from None
        return with_fields(base, values, lambda name: name, "min_tokens")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's `continuous_usage_stats`, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def choices(self) -> int:
        """How many choices each prompt gets (`n`)."""
        return self.n or 1

    def requested_logprobs(self) -> int | None:
        """How many top logprobs each token carries (0: the sampled token's alone); None: no logprobs. Raises
        InvalidField where the request's fields about them do not go together."""
        return None


def _token_ids_of(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias with its keys read as token ids; a key that is not one is a 400 naming logit_bias."""
    read = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidField(
                "logit_bias", f"keys must be token ids (non-negative integers), got {key[:40]!r}"
            )
        read[int(key)] = value
    return read


def with_fields(
    base: SamplingParams, given: dict[str, Any], field_of: Callable[[str], str], together: str
) -> SamplingParams:
    """`base` with the `given` values; raises InvalidField naming the field at fault (`field_of` a
    SamplingParams name): the one that breaks a rule alone, else `together`, the field whose rule involves
    another (min_tokens against max_tokens)."""
    try:
        return replace(base, **given)
    except InvalidRequest as exc:
        refused = exc
    for name, value in given.items():  # one at a time, so that the error names the field that broke a rule
        try:
            replace(base, **{name: value})
        except InvalidRequest as exc:
            raise InvalidField(field_of(name), str(exc)) from None
    raise InvalidField(together, str(refused)) from None
