"""The spoken answers a later turn may refer to by id, as OpenAI's multi-turn audio does: a chat's assistant
message `{"role": "assistant", "audio": {"id": ...}}` stands for the earlier answer whose audio had that id.

Only the transcript is kept (the Thinker reads an earlier answer as its text), in this process's memory, for
`retention_s` seconds and for at most `max_answers` answers (the oldest go first); `expires_at` of the answer
says when it goes. A restarted server, or another replica, knows none of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omnistage.server.bounded_store import BoundedStore

DEFAULT_RETENTION_S = 3600
DEFAULT_MAX_ANSWERS = 10_000


class SpokenAnswers:
    """Transcripts of spoken answers by their audio id, bounded by age and by count."""

    def __init__(
        self,
        retention_s: int = DEFAULT_RETENTION_S,
        max_answers: int = DEFAULT_MAX_ANSWERS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_s, self.max_answers = retention_s, max_answers
        self._kept: BoundedStore[str] = BoundedStore(retention_s, max_answers, clock)

    def keep(self, audio_id: str, transcript: str) -> int:
        """Keep an answer's transcript; when it goes (Unix seconds: the answer's `expires_at`)."""
        return self._kept.keep(audio_id, transcript)

    def transcript(self, audio_id: str) -> str | None:
        """The transcript of the answer `audio_id`, or None when it is unknown or has expired."""
        return self._kept.get(audio_id)

    def __len__(self) -> int:
        return len(self._kept)
