"""One request's token state inside an autoregressive stage: plain data, no tensors, with the stage's own state of
the request (`Sequence[StateT]`); and what a token runner reads of a request beyond its ids (`PromptInputs`), the
base of a text stage's state of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from omnistage.engine.prefix_keys import PageKeys
    from omnistage.engine.stages.encoders import MultimodalEmbeds
    from omnistage.engine.stages.token_runner import HiddenTap
    from omnistage.models.layers.rotary import PromptPositions


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH = auto()
    FINISHED_ABORTED = auto()
    FINISHED_ERROR = auto()

    @property
    def is_finished(self) -> bool:
        # identities, not a set (an Enum member hashes in Python) nor the name: asked several times per
        # sequence per step
        return self is not _WAITING and self is not _RUNNING


_WAITING, _RUNNING = SequenceStatus.WAITING, SequenceStatus.RUNNING

StateT = TypeVar("StateT")


# eq=False: a sequence is an identity (hashable, compared by object), not a value.
@dataclass(eq=False)
class Sequence(Generic[StateT]):
    """Prompt, generated tokens, KV progress and page table of one request, and `data`, the stage's state of it: a
    text stage's `RequestState` (`PromptInputs` and more), a row stage's `RowState`."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # the prefix cache's keys of its first full pages, its prompt's and then those its sampled ids fill
    # (prefix_keys.py; None: its stage caches no prefix), and how many pages at the head of `page_ids` are in
    # the cache: taken from it or entered once computed
    prefix: PageKeys | None = None
    num_cached_pages: int = 0
    data: StateT = field(kw_only=True)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without copying the whole prompt (a decode step asks for one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        status = self.status
        return status is not _WAITING and status is not _RUNNING


@dataclass
class PromptInputs:
    """What a token runner reads of a request beyond its ids: its M-RoPE positions, its media's encoder rows for
    the placeholders, and the hidden states of prompt rows a later stage reads; none of them for plain text."""

    mrope: PromptPositions | None = None
    mm: MultimodalEmbeds | None = None
    tap: HiddenTap | None = None
