"""The prefix cache's keys of a prompt's full pages: pure bookkeeping over ids, positions and bytes.

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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import xxhash


@dataclass(frozen=True)
class MediaRows:
    """One kind of media of a prompt on the host: the placeholder positions it fills (ascending) and, per
    position, the bytes of what is written there."""

    rows: np.ndarray  # int64 [n]
    values: np.ndarray  # uint8 [n, bytes per row]


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
    keys: list[bytes] = []
    previous = b""
    for page in range(num_pages):
        start, end = page * page_size, (page + 1) * page_size
        h = hashlib.blake2b(previous, digest_size=32)
        h.update(ids[start:end].tobytes())
        if positions is not None:
            h.update(np.ascontiguousarray(positions[:, start:end], dtype=np.int64).tobytes())
        for kind in media:
            lo, hi = np.searchsorted(kind.rows, [start, end])
            # a kind's count first: the bytes that follow are read in one way only
            h.update(np.int64(hi - lo).tobytes())
            h.update((kind.rows[lo:hi] - start).astype(np.int64).tobytes())
            h.update(xxhash.xxh3_128_digest(np.ascontiguousarray(kind.values[lo:hi]).data))
        previous = h.digest()
        keys.append(previous)
    return keys
