"""The prefix cache's keys of a sequence's full pages: pure bookkeeping over ids, positions and bytes.

A page's KV is a function of everything a causal decoder saw up to its last row: the ids, the rows that
replaced media placeholders, and the positions of every row before it and in it. So a page's key chains the
previous page's key with what the page adds: its ids, its M-RoPE positions (a multimodal prompt's positions
depend on its media's grids and timing, not only on the ids), and, at each placeholder it holds, the bytes of
the encoder rows written there. Two prompts with the same placeholder ids but other images or audio never
share a page; two whose encoders gave bit-identical rows do, however they were encoded (a clip encoded whole,
or a growing clip whose complete attention windows gave the same rows).

The rows' bytes are many (a 30 s 720p video's are ~90 MB), so each page's share of them enters the chained
hash as its 128-bit XXH3 digest: read at several GB/s where BLAKE2b reads a few hundred MB/s, which would put
a large video's hashing in its time to first token. The rows stand for the vision tower's deepstack levels
too: both are that tower's outputs on one input.

A sequence's prompt pages are keyed at admission, and the pages its sampled ids fill as those ids become known
(`PageKeys.extend`): a sampled row at index i sits at position i + delta in every stream (the prompt's M-RoPE
delta), where the next turn of a chat places the same ids when its prompt repeats the answer after the same
prompt. Its keys then meet the answer's pages, and the next turn prefills only what is new.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash


@dataclass(frozen=True)
class MediaRows:
    """One kind of media of a prompt on the host: the placeholder positions it fills (ascending) and, per
    position, the bytes of what is written there."""

    rows: np.ndarray  # int64 [n]
    values: np.ndarray  # uint8 [n, bytes per row]

    def from_row(self, row: int) -> MediaRows:
        """The rows at `row` and after, copied (the rest of the bytes can go)."""
        first = int(np.searchsorted(self.rows, row))
        return MediaRows(self.rows[first:].copy(), self.values[first:].copy())


def page_keys(
    token_ids: list[int],
    page_size: int,
    num_pages: int,
    positions: np.ndarray | None = None,
    media: tuple[MediaRows, ...] = (),
) -> list[bytes]:
    """The keys of the prompt's first `num_pages` pages (at most its full ones); `positions` `[3, prompt_len]`
    for an M-RoPE prompt (None: row i at position i, which the ids' place already says)."""
    num_pages = min(num_pages, len(token_ids) // page_size)
    ids = np.asarray(token_ids[: num_pages * page_size], dtype=np.int64)
    return _chain(b"", ids, 0, page_size, positions, media)


def _chain(
    previous: bytes,
    ids: np.ndarray,
    first_row: int,
    page_size: int,
    positions: np.ndarray | None,
    media: tuple[MediaRows, ...],
) -> list[bytes]:
    """The keys of the full pages of `ids`, rows `first_row`.. of a sequence, after the key `previous` (b"":
    none); `positions` `[3, >= len(ids)]` of those rows."""
    pages = len(ids) // page_size
    id_bytes = ids[: pages * page_size].astype(np.int64, copy=False).tobytes()
    width = page_size * 8
    # each page's [3, page_size] positions, laid out page after page
    position_bytes = b""
    if positions is not None:
        by_page = positions[:, : pages * page_size].reshape(3, pages, page_size).transpose(1, 0, 2)
        position_bytes = np.ascontiguousarray(by_page, dtype=np.int64).tobytes()
    # per kind, the rows' bounds in each page and each row's place in its page, found for all pages at once
    kinds = []
    for kind in media:
        bounds = np.searchsorted(kind.rows, first_row + np.arange(pages + 1) * page_size).tolist()
        places = ((kind.rows - first_row) % page_size).astype(np.int64).tobytes()
        kinds.append((bounds, places, np.ascontiguousarray(kind.values)))
    keys: list[bytes] = []
    for page in range(pages):
        h = hashlib.blake2b(previous, digest_size=32)
        h.update(id_bytes[page * width : (page + 1) * width])
        if positions is not None:
            h.update(position_bytes[3 * page * width : 3 * (page + 1) * width])
        for bounds, places, values in kinds:
            lo, hi = bounds[page], bounds[page + 1]
            # a kind's count first: the bytes that follow are read in one way only
            h.update((hi - lo).to_bytes(8, sys.byteorder, signed=True))
            h.update(places[lo * 8 : hi * 8])
            h.update(xxhash.xxh3_128_digest(values[lo:hi].data))
        previous = h.digest()
        keys.append(previous)
    return keys


@dataclass
class PageKeys:
    """The keys of a sequence's first full pages (`keys`, in order), and what keys the pages after them: its
    prompt's M-RoPE positions and delta, the media rows of its pages not keyed yet, a bound, and the pages in
    which a later stage reads the hidden rows kept beside the pool's pages (TokenRunner.keep_taps): a page
    whose rows were not all prefilled (a decode step keeps none) is not given to it (kv_cache.py)."""

    keys: list[bytes]
    page_size: int
    positions: np.ndarray | None = None  # [3, prompt_len] (M-RoPE); None: row i at position i
    delta: int = 0  # a row i past the prompt sits at i + delta in every stream (M-RoPE)
    media: tuple[MediaRows, ...] = ()
    end: int | None = None  # no page from this one on is keyed; None: no bound
    reads_kept_rows: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of_prompt(
        cls,
        token_ids: list[int],
        page_size: int,
        positions: np.ndarray | None = None,
        delta: int = 0,
        media: tuple[MediaRows, ...] = (),
        end: int | None = None,
        reads_kept_rows: frozenset[int] = frozenset(),
    ) -> PageKeys:
        """The keys of the prompt's full pages (up to `end`), ready to key the pages its sampled ids fill."""
        keys = cls([], page_size, positions, delta, media, end, reads_kept_rows)
        full = len(token_ids) // page_size
        keys.extend(full, lambda start, stop: token_ids[start:stop])
        return keys

    def extend(self, num_pages: int, token_ids: Callable[[int, int], list[int]]) -> None:
        """Key the sequence's pages up to `num_pages` (those whose rows are computed), reading the ids of its
        rows [start, stop) as `token_ids(start, stop)`, up to the bound and to the first page that holds an id
        not known yet (negative: a token decoded ahead, decode_ahead.PLACEHOLDER); it is keyed later."""
        first = len(self.keys)
        if self.end is not None:
            num_pages = min(num_pages, self.end)
        if num_pages <= first:
            return
        start, stop = first * self.page_size, num_pages * self.page_size
        ids = np.asarray(token_ids(start, stop), dtype=np.int64)
        unknown = np.flatnonzero(ids < 0)
        known = int(unknown[0]) if len(unknown) else len(ids)
        stop = start + known // self.page_size * self.page_size
        if stop == start:
            return
        ids = ids[: stop - start]
        previous = self.keys[-1] if self.keys else b""
        self.keys += _chain(previous, ids, start, self.page_size, self._positions(start, stop), self.media)
        self.media = tuple(kind.from_row(stop) for kind in self.media)

    def _positions(self, start: int, stop: int) -> np.ndarray | None:
        """`[3, stop - start]` positions of rows [start, stop): the prompt's, then each later row's index +
        delta."""
        if self.positions is None:
            return None
        prompt_len = self.positions.shape[1]
        head = self.positions[:, start:stop]
        if stop <= prompt_len:
            return head
        tail = np.arange(max(start, prompt_len), stop, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)
