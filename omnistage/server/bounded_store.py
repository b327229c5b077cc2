"""What the server keeps in memory for a later request to name by id, bounded by age and by count: the oldest
go first, and each goes `retention_s` seconds after it was kept. A restarted server, or another replica, knows
none of them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedStore(Generic[T]):
    """Values by id, each kept `retention_s` seconds, at most `max_kept` of them (0 of either: none kept)."""

    def __init__(self, retention_s: int, max_kept: int, clock: Callable[[], float] = time.time) -> None:
        self.retention_s, self.max_kept, self.clock = retention_s, max_kept, clock
        self._kept: OrderedDict[str, tuple[T, int]] = OrderedDict()  # id: (value, expires_at), oldest first
        self._lock = threading.Lock()  # kept from worker threads as well as the event loop

    def keep(self, key: str, value: T) -> int:
        """Keep `value` as `key`; when it goes (Unix seconds)."""
        expires_at = int(self.clock()) + self.retention_s
        if self.max_kept == 0 or self.retention_s == 0:
            return expires_at
        with self._lock:
            self._kept[key] = (value, expires_at)
            self._kept.move_to_end(key)
            while len(self._kept) > self.max_kept:
                self._kept.popitem(last=False)
        return expires_at

    def get(self, key: str) -> T | None:
        """The value kept as `key`, or None when it is unknown or has expired."""
        with self._lock:
            self._expire()
            kept = self._kept.get(key)
        return kept[0] if kept is not None else None

    def pop(self, key: str) -> T | None:
        """Forget `key`; its value, or None when it was not kept."""
        with self._lock:
            self._expire()
            kept = self._kept.pop(key, None)
        return kept[0] if kept is not None else None

    def _expire(self) -> None:
        now = self.clock()
        while self._kept:  # the oldest expire first
            if next(iter(self._kept.values()))[1] > now:
                break
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)
