"""A text stage's constrained decoding (`Constraints`): the grammars compiled against its vocabulary, and its
constrained requests on their way in: a constraint not compiled yet compiles on a thread of
its own while the stage's steps go on, and its request waits here (`Compiling`) until its matcher is ready, so
that a new schema's compile (tens of ms over Qwen's vocabulary, benchmarks/RESULTS.md, "Grammar libraries on the
CPU") never stalls the other requests' steps. A constraint compiled lately is in the cache and its request goes
straight in."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from tokenizers import Tokenizer

from omnistage.request import StructuredOutput

if TYPE_CHECKING:
    from omnistage.engine.structured import Grammars, GrammarState

P = TypeVar("P")  # what the stage keeps of a request until it is queued


@dataclass
class Waiting(Generic[P]):
    """A request waiting for its constraint's compile."""

    request_id: str
    parked: P
    future: Future[GrammarState]


class Compiling(Generic[P]):
    """The requests whose constraints compile on the grammar thread, in arrival order."""

    def __init__(self, state_of: Callable[[StructuredOutput], GrammarState]) -> None:
        self._state_of = state_of
        self._executor: ThreadPoolExecutor | None = None  # started at the first compile
        self._waiting: dict[str, Waiting[P]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, structured: StructuredOutput, parked: P) -> None:
        """Compile `structured` on the grammar thread; `parked` waits for it (`ready`)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        future = self._executor.submit(self._state_of, structured)
        self._waiting[request_id] = Waiting(request_id, parked, future)

    def ready(self) -> list[tuple[P, GrammarState | Exception]]:
        """The requests whose compile has ended, each with its matcher or the compile's error."""
        done = [w for w in self._waiting.values() if w.future.done()]
        for w in done:
            del self._waiting[w.request_id]
        return [(w.parked, _result(w.future)) for w in done]

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request; whether it was waiting."""
        return self._waiting.pop(request_id, None) is not None


class Constraints(Generic[P]):
    """A text stage's constraints: compiled against its vocabulary at first use (`grammars`), a matcher per
    constrained sequence (`state`), and the requests waiting for a compile (`compiling`)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._vocabulary = tokenizer, vocab_size, eos_token_ids
        self._grammars: Grammars | None = None  # built at the first constrained request
        self.compiling: Compiling[P] = Compiling(self.state)

    @property
    def grammars(self) -> Grammars:
        """The constraints compiled against the model's vocabulary (structured.py), built at first use: on the
        grammar thread, as the vocabulary's tables take seconds."""
        if self._grammars is None:
            # imported here: xgrammar's import takes seconds, which a stage never constrained never pays
            from omnistage.engine.structured import Grammars

            self._grammars = Grammars(*self._vocabulary)
        return self._grammars

    def compiled(self, structured: StructuredOutput) -> bool:
        """Whether `structured` is compiled already (its request need not wait)."""
        return self._grammars is not None and self._grammars.compiled(structured)

    def state(self, structured: StructuredOutput) -> GrammarState:
        """A new sequence's matcher of `structured`, compiled once per distinct constraint; raises
        InvalidConstraint."""
        return self.grammars.state(structured)

    @staticmethod
    def check(structured: StructuredOutput) -> None:
        """Raise InvalidConstraint for a constraint the grammar library refuses (quick: no vocabulary)."""
        # imported here: xgrammar's import takes seconds, which a stage never constrained never pays
        from omnistage.engine.structured import check

        check(structured)


def _result(future: Future[GrammarState]) -> GrammarState | Exception:
    exc = future.exception()
    if isinstance(exc, Exception):
        return exc
    return future.result()
