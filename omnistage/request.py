"""One request as it travels from where it enters to the pipeline: its prompt, its sampling (vLLM's names and
defaults) and, to speak, its speech.

Shared by the edge that builds and checks a request (server/, llm.py) and the pipeline and stages that run it
(pipeline/, engine/): plain Python, so that the server imports it without the engine.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnistage.errors import InvalidRequest

if TYPE_CHECKING:
    from omnistage.models.layers.rotary import PromptPositions
    from omnistage.models.multimodal import MultimodalInputs

# Below this a temperature counts as greedy: dividing logits by it would only amplify float noise (vLLM's bound).
GREEDY_TEMPERATURE = 1e-5
# The most log-probabilities beside the sampled token's that one token carries: OpenAI's bound of top_logprobs,
# and vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# OpenAI's range of a logit bias; its floor bans the token outright (the sampler makes it -inf).
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class ToolSchema:
    """One function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: str  # JSON text of the arguments' schema


@dataclass(frozen=True)
class StructuredOutput:
    """What constrained decoding holds the output to: exactly one of a JSON schema, any JSON object, a grammar,
    or calls of the given tools (Qwen's `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`)."""

    json_schema: str | None = None  # JSON text of the schema
    json_object: bool = False
    grammar: str | None = None  # EBNF
    tools: tuple[ToolSchema, ...] = ()
    parallel_tool_calls: bool = True  # with tools: one call or more


@dataclass
class SamplingParams:
    """Per-request decoding controls; `stop` and `stop_token_ids` are normalised to lists."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the log-probabilities of this many most likely tokens beside each sampled one's (0: the sampled one's
    # only); None: none
    logprobs: int | None = None
    # added to the token's logit before sampling, in [-100, 100]; -100 bans the token
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None  # constrained decoding: every output matches it

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field that breaks its rule.

        Beyond each field's rule, integers must fit int64 and floats must be finite numbers: a value the
        sampler's tensors cannot hold would fail the sampler, and with it the whole batch.
        """
        for name in _INT_FIELDS:
            if (value := getattr(self, name)) is not None or name not in _OPTIONAL:
                _check_int64(name, value)
        for value in self.stop_token_ids or []:
            _check_int64("stop_token_ids", value)
        for name in _FLOAT_FIELDS:
            if not _is_number(getattr(self, name)):
                _invalid(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.n != 1:
            _invalid(f"n must be 1 (only one choice per request is supported), got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            _invalid(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            _invalid(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _invalid(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not self.temperature >= 0:  # written this way round so that NaN fails too
            _invalid(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _invalid(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            _invalid(f"top_k must be >= 1, or 0 or -1 to disable it, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            _invalid(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            _invalid(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            _invalid(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            _invalid(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        for name in _FLOAT_FIELDS:
            _check_finite(name, getattr(self, name))
        if not all(isinstance(s, str) and s for s in self.stop or []):
            _invalid(f"stop must hold only non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []):
            _invalid(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _invalid(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)


def talker_sampling_defaults() -> SamplingParams:
    """The released Talker's sampling (its generation defaults); max_tokens None: the pipeline's audio cap."""
    return SamplingParams(max_tokens=None, temperature=0.9, top_k=50, repetition_penalty=1.05)


# The most codec frames one request speaks: transformers' limit for Qwen3-Omni's talker (327.7 s), and the
# length the Talker's sequences are planned for (its pages, its graphs). The server refuses more at its edge
# (server/protocol/speech.py), the pipeline at admission.
MAX_AUDIO_FRAMES = 4096


@dataclass
class SpeechParams:
    """Speak the reply. `talker.max_tokens` caps the audio in codec frames (12.5 per second; None: a cap
    proportional to the text); `talker.seed` also seeds the code predictor's draws. `reply_token_ids` speaks
    exactly those tokens (text-to-speech): the Thinker does not run."""

    voice: str = "ethan"
    talker: SamplingParams = field(default_factory=talker_sampling_defaults)
    reply_token_ids: list[int] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A request built and checked once, where it enters (the server's edge, `LLM`): a prompt laid out by the
    processor, how to sample the reply and, with `speech`, how to speak it. It travels as it is to the pipeline,
    whose `validate` checks, once, what only its stages know (the context, the vocabulary, the page pools) as
    it admits it (ValidRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    mrope: PromptPositions | None = None  # None where every position is its own index (no images)
    mm: MultimodalInputs | None = None  # what the encoders read; None without attachments
    speech: SpeechParams | None = None  # speak the reply too
    # How many samples of this prompt run at once, this one among them (a request's `n` or `best_of`, fanned
    # out by the server): admission makes sure that all of them fit the page pool together.
    samples: int = 1
    # Deliver only the finished output (and what keeps the request out): a caller that answers once, at the
    # end (a response not streamed), is not handed an output per step that it would drop.
    final_only: bool = False


@dataclass(frozen=True)
class ValidRequest:
    """A GenerationRequest its pipeline's `validate` passed, with what that one check worked out: the Thinker's
    effective max_tokens. Only `validate` makes one; what runs after it (admission, the stages) trusts it and
    checks nothing again."""

    request: GenerationRequest
    max_tokens: int


_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs")
_OPTIONAL = ("max_tokens", "seed", "logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INT64 = range(-(2**63), 2**63)


def _is_number(value: object) -> bool:
    # bool is an int to Python, but `temperature=True` is a mistake, not a 1.0. numbers.Real takes numpy's.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int64(name: str, value: object) -> None:
    if not (_is_number(value) and isinstance(value, numbers.Integral) and int(value) in _INT64):
        _invalid(f"{name} must be an integer in [-2**63, 2**63), got {reprlib.repr(value)}")


def _check_finite(name: str, value: float) -> None:
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        _invalid(f"{name} must be finite, got {reprlib.repr(value)}")


def _check_logit_bias(bias: object) -> None:
    """Token ids (non-negative int64s; the vocabulary's bound is the stage's to check) to finite biases in
    OpenAI's range."""
    if not isinstance(bias, dict):
        _invalid(f"logit_bias must map token ids to biases, got {reprlib.repr(bias)}")
        return
    for token, value in bias.items():
        _check_int64("logit_bias", token)
        if token < 0:
            _invalid(f"logit_bias must map non-negative token ids, got {token}")
        if not _is_number(value):
            _invalid(f"logit_bias of token {token} must be a number, got {reprlib.repr(value)}")
        _check_finite("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            _invalid(f"logit_bias of token {token} must be in [-100, 100], got {value}")


def _invalid(message: str) -> None:
    raise InvalidRequest(message)
