"""The KV page pool: which fixed-size pages are free, which sequences hold the rest, and the prefix cache.

The pool holds no tensors; the KV tensors live with the model runner and are indexed by these page ids.

Prefix cache: a full page, once computed, is entered under its key (prefix_keys.py: a chained hash of its
content and of everything before it): a prompt's pages, and those its sampled ids fill once their ids are known
(a chat's next turn repeats the answer). Sequences whose prompts start with the same pages then hold the same
page ids: a page counts its holders, and when the last one lets go it stays in the cache, evictable, on an LRU
list. A later prompt with its key takes it back from there (`take_prefix`). Only when a fresh page is needed
and no never-cached page is left is the least recently released one evicted: its key is dropped and its id
handed out. A cached page is never written again: a sequence computes only the pages after its cached prefix.
A page holding rows past its sequence's prompt may have been computed, in part, by decode steps, which keep no
hidden rows beside it: a sequence that reads such rows in a page (`PageKeys.reads_kept_rows`) does not take it.

Accounting: every page is exactly one of free (never cached, or evicted), evictable (cached, no holder) or
used (held by at least one sequence). `num_free` counts free and evictable pages alike (both can be handed
out), `num_used` the held ones, and they always add up to `num_pages`.
"""

import heapq
from collections import OrderedDict
from typing import Any

from omnistage.engine.sequence import Sequence
from omnistage.errors import RequestTooLarge


class PagePool:
    """`num_pages` pages of `page_size` tokens each, handed out lowest id first (never-cached pages before
    evicting a cached one)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages))  # a heap; sorted is a valid heap
        self._holders: dict[int, int] = {}  # used page -> how many sequences hold it
        self._evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached pages no one holds, least recent first
        self._cached: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # page -> key, for every cached page (used or evictable)
        self._decoded: set[int] = set()  # cached pages holding rows past their sequence's prompt
        # tokens looked up at admission (a readmitted sequence's outputs too), and those found cached: the
        # prefix cache's hit rate
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._holders)

    @property
    def num_cached(self) -> int:
        """Pages the prefix cache holds a key for, used or evictable."""
        return len(self._key_of)

    def holders(self, page: int) -> int:
        """How many sequences hold `page` (0: free or evictable)."""
        return self._holders.get(page, 0)

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
        """`n` fresh pages, each with one holder: free ones first, then the least recently released cached
        ones, their keys dropped."""
        if n > self.num_free:
            raise RuntimeError(f"cannot allocate {n} pages: only {self.num_free} are free")
        pages = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._key_of.pop(page)]
                self._decoded.discard(page)
            self._holders[page] = 1
            pages.append(page)
        return pages

    def free(self, page_ids: list[int]) -> None:
        """Let go of one hold on each page; a page no one holds then becomes free, or evictable if it is
        cached. A page not held, or listed twice, is a bug and raises (before anything changes).

        A cached page released later is evicted later: release a sequence's pages last page first, so that
        the tail of a prefix goes before its head (which more prompts share)."""
        bad = [p for p in page_ids if p not in self._holders]
        if bad or len(set(page_ids)) != len(page_ids):
            raise ValueError(f"freeing pages that are not in use or listed twice: {sorted(page_ids)}")
        for p in page_ids:
            self._holders[p] -= 1
            if self._holders[p]:
                continue
            del self._holders[p]
            if p in self._key_of:
                self._evictable[p] = None
            else:
                heapq.heappush(self._free, p)

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that the cache holds; nothing is taken."""
        pages = []
        for key in keys:
            page = self._cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def take(self, pages: list[int]) -> None:
        """Hold cached `pages` (`cached_prefix`'s) for one more sequence; an evictable one is used again."""
        for p in pages:
            if p in self._holders:
                self._holders[p] += 1
            else:
                del self._evictable[p]
                self._holders[p] = 1

    def enter(self, page: int, key: bytes, decoded: bool = False) -> None:
        """Cache held `page`, fully computed, under `key` (`decoded`: it holds rows past its sequence's prompt);
        a key cached already keeps its page (this one stays uncached: two sequences computed the same content
        at once), unless decode steps computed that one and prefilling this one: a sequence reading kept
        hidden rows could never take the first, and a conversation's next turns would compute it and every
        page after it again."""
        if page not in self._holders:
            raise ValueError(f"caching page {page}, which no sequence holds")
        cached = self._cached.get(key)
        if cached is not None and cached in self._decoded and not decoded and page not in self._key_of:
            self._uncache(cached)
        if key not in self._cached and page not in self._key_of:
            self._cached[key] = page
            self._key_of[page] = key
            if decoded:
                self._decoded.add(page)

    def _uncache(self, page: int) -> None:
        """Drop cached `page`'s key: held, it is freed when let go; evictable, it is free now."""
        del self._cached[self._key_of.pop(page)]
        self._decoded.discard(page)
        if page in self._evictable:
            del self._evictable[page]
            heapq.heappush(self._free, page)

    def take_prefix(self, seq: Sequence[Any]) -> int:
        """Give `seq`, holding no page yet, the cached pages of its longest cached prefix and mark their tokens
        computed, leaving at least its last token to compute (the step after it samples); returns the tokens
        so found, the queries and hits counted."""
        prefix = seq.prefix
        if prefix is None or seq.page_ids:
            return 0
        most = (seq.num_tokens - 1) // self.page_size
        pages = self.cached_prefix(prefix.keys[:most])
        unkept = (i for i, p in enumerate(pages) if p in self._decoded and i in prefix.reads_kept_rows)
        pages = pages[: next(unkept, len(pages))]
        self.take(pages)
        seq.page_ids = pages
        seq.num_cached_pages = len(pages)
        seq.num_computed_tokens = len(pages) * self.page_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def untake_prefix(self, seq: Sequence[Any], found: int) -> None:
        """Undo `take_prefix` for a sequence that was not admitted after all (its `found` tokens uncounted)."""
        if seq.prefix is None:
            return
        self.queried_tokens -= seq.num_tokens
        self.hit_tokens -= found
        self.release(seq)
        seq.num_computed_tokens = 0

    def cache_computed(self, seq: Sequence[Any]) -> None:
        """Enter the full pages of `seq` computed since it last came here into the cache, keying those its
        sampled ids filled as far as their ids are known (a page whose ids are not is entered on a later
        call: the next step's, or its end's)."""
        prefix = seq.prefix
        full = seq.num_computed_tokens // self.page_size
        if prefix is None or full <= seq.num_cached_pages:
            return
        prefix.extend(full, seq.token_ids)
        full = min(full, len(prefix.keys))
        for i in range(seq.num_cached_pages, full):
            self.enter(seq.page_ids[i], prefix.keys[i], (i + 1) * self.page_size > seq.num_prompt_tokens)
        seq.num_cached_pages = max(seq.num_cached_pages, full)

    def ensure_capacity(self, seq: Sequence[Any], num_tokens: int) -> bool:
        """Grow `seq.page_ids` to cover `num_tokens` tokens; all or nothing, False if pages are short."""
        # the common case (asked for every running sequence every step): its pages already cover them
        if num_tokens <= len(seq.page_ids) * self.page_size:
            return True
        missing = self.pages_for(num_tokens) - len(seq.page_ids)
        if missing > self.num_free:
            return False
        seq.page_ids.extend(self.allocate(missing))
        return True

    def release(self, seq: Sequence[Any]) -> None:
        """Let go of every page of `seq`, last first (see `free`), and empty its page table."""
        self.free(seq.page_ids[::-1])
        seq.page_ids = []
        seq.num_cached_pages = 0
