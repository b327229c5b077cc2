"""The KV page pool: which fixed-size pages are free and which sequence owns the rest.

The pool holds no tensors; the KV tensors live with the model runner and are indexed by these page ids.
"""

import heapq
from typing import Any

from omnistage.engine.sequence import Sequence
from omnistage.errors import RequestTooLarge


class PagePool:
    """`num_pages` pages of `page_size` tokens each, handed out lowest id first."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages))  # a heap; sorted is a valid heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check_admissible(self, num_tokens: int) -> None:
        """Raise RequestTooLarge if `num_tokens` could not fit even the empty pool."""
        needed = self.pages_for(num_tokens)
        if needed > self.num_pages:
            raise RequestTooLarge(
                f"request needs {needed} pages ({num_tokens:,} tokens) but the pool has {self.num_pages} pages"
            )

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} pages: only {len(self._free)} are free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, page_ids: list[int]) -> None:
        """Return pages to the pool; a page that is not in use, or listed twice, is a bug and raises."""
        bad = [p for p in page_ids if p not in self._used]
        if bad or len(set(page_ids)) != len(page_ids):
            raise ValueError(f"freeing pages that are not in use or listed twice: {sorted(page_ids)}")
        for p in page_ids:
            self._used.remove(p)
            heapq.heappush(self._free, p)

    def ensure_capacity(self, seq: Sequence[Any], num_tokens: int) -> bool:
        """Grow `seq.page_ids` to cover `num_tokens` tokens; all or nothing, False if pages are short."""
        # the common case (asked for every running sequence every step): its pages already cover them
        if num_tokens <= len(seq.page_ids) * self.page_size:
            return True
        missing = self.pages_for(num_tokens) - len(seq.page_ids)
        if missing > len(self._free):
            return False
        seq.page_ids.extend(self.allocate(missing))
        return True

    def release(self, seq: Sequence[Any]) -> None:
        """Free every page of `seq` and empty its page table."""
        self.free(seq.page_ids)
        seq.page_ids = []
