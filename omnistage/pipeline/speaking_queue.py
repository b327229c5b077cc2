"""Where Qwen3-Omni's speaking requests wait for their turn: at most `max_speaking` speak at once (a speaking step
serves that many at about the cost of one, `qwen3_omni_speech.max_speaking`), the others wait in arrival order.
Text requests never wait here. Plain bookkeeping: the pipeline starts a request whose turn came."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.request import ValidRequest


@dataclass(frozen=True)
class Waiting:
    """A speaking request validated and waiting for its turn, since `arrival` (monotonic seconds)."""

    valid: ValidRequest
    arrival: float


class SpeakingQueue:
    """The speaking requests waiting for a turn, first come first served; and those whose turn came but whose
    Thinker refused them then (`refused`), until the next step's outputs carry them."""

    def __init__(self, max_speaking: int) -> None:
        self.max_speaking = max_speaking
        self._waiting: deque[Waiting] = deque()
        self.refused: list[RequestOutput] = []

    def __len__(self) -> int:
        """The requests waiting (not the refused)."""
        return len(self._waiting)

    def push(self, valid: ValidRequest, arrival: float) -> None:
        self._waiting.append(Waiting(valid, arrival))

    def has_turn(self, num_speaking: int) -> bool:
        """Whether a request waits while `num_speaking` (fewer than max_speaking) speak."""
        return bool(self._waiting) and num_speaking < self.max_speaking

    def next_turn(self, num_speaking: int) -> Waiting | None:
        """The oldest waiting request, taken out, if its turn came with `num_speaking` speaking."""
        return self._waiting.popleft() if self.has_turn(num_speaking) else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Take a waiting request out; its final output (finished, "abort"), or None if it was not waiting."""
        for waiting in self._waiting:
            if waiting.valid.request.request_id == request_id:
                self._waiting.remove(waiting)
                r = waiting.valid.request
                completion = CompletionOutput(0, "", [], finish_reason="abort")
                return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], finished=True)
        return None

    def take_refused(self) -> list[RequestOutput]:
        refused, self.refused = self.refused, []
        return refused
