"""The spoken answers a later turn may refer to by id, as OpenAI's multi-turn audio does: a chat's assistant
message `{"role": "assistant", "audio": {"id": ...}}` stands for the earlier answer whose audio had that id.

Only the transcript is kept (the Thinker reads an earlier answer as its text), in this process's memory, for
`retention_s` seconds and for at most `max_answers` answers (the oldest go first); `expires_at` of the answer
says when it goes. A restarted server, or another replica, knows none of them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

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
        self.retention_s, self.max_answers, self.clock = retention_s, max_answers, clock
        self._kept: OrderedDict[str, tuple[str, int]] = (
            OrderedDict()
        )  # id: (transcript, expires_at), oldest first
        self._lock = threading.Lock()  # kept from worker threads (a spoken response is encoded on one)

    def keep(self, audio_id: str, transcript: str) -> int:
        """Keep an answer's transcript; when it goes (Unix seconds: the answer's `expires_at`)."""
        expires_at = int(self.clock()) + self.retention_s
        if self.max_answers == 0 or self.retention_s == 0:
            return expires_at
        with self._lock:
            self._kept[audio_id] = (transcript, expires_at)
            self._kept.move_to_end(audio_id)
            while len(self._kept) > self.max_answers:
                self._kept.popitem(last=False)
        return expires_at

    def transcript(self, audio_id: str) -> str | None:
        """The transcript of the answer `audio_id`, or None when it is unknown or has expired."""
        now = self.clock()
        with self._lock:
            while self._kept:  # the oldest expire first
                oldest = next(iter(self._kept.values()))
                if oldest[1] > now:
                    break
                self._kept.popitem(last=False)
            kept = self._kept.get(audio_id)
        return kept[0] if kept is not None else None

    def __len__(self) -> int:
        return len(self._kept)
