"""The towers' rows of clips, images and videos seen before, kept on the host.

A voice conversation sends every earlier turn's clip again with each turn, and a chat about a video its video.
The tower's rows of a clip differ in their last bits with the clips it is batched beside, and the prefix cache
keys pages by those rows' bytes (prefix_keys.py): rows encoded again would miss every page from the first clip
on. Kept rows make the same clip give the very same rows in every later request, and spare the tower the work
(a 30 s video's ~300 ms on an H100).

A clip is known by its processor's digest of its samples (`clip_digest`), an image or a video by the digest of
its patches (`patches_digest`), both taken on the host; an image's or a video's rows are kept with their
deepstack levels' (a 30 s 720p video's ~350 MB: `stages.encoders.cache_mib`). The rows live in
CPU memory (pinned beside a GPU, so that copying them back waits for nothing queued), outside the GPU's memory
plan, least recently used first out once they pass the byte budget. Only the engine thread encodes
(admission), so the cache takes no lock.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """Rows by clip key, on the host, bounded by `max_bytes` (0: nothing is kept), least recently used out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # clips found
        self.misses = 0  # clips the tower ran for
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The rows kept for `key` (on the host), now the most recently used; None: not kept. Their copy from the
        device may still be queued: they are for copying back to the device on the same stream, not for reading
        on the host."""
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
        return rows

    def put(self, key: bytes, rows: torch.Tensor | list[torch.Tensor]) -> None:
        """Keep a copy of `rows` on the host, from a GPU queued behind the work that computes them and not
        waited for: the rows kept are only ever copied back to the device (`get`), behind the same work; rows
        larger than the whole budget are not kept. Several tensors of one row width, matrices or stacks of
        them (a video's rows [n, H] and its deepstack levels [L, n, H]), are kept as one, their rows one after
        another in the order given."""
        parts = [rows] if isinstance(rows, torch.Tensor) else rows
        # matrices copied one by one: a level of a deepstack split from a batch's is a contiguous matrix, where
        # the levels reshaped together would be copied on the device first
        flat = [m.detach() for part in parts for m in (part.unbind(0) if part.dim() == 3 else [part])]
        size = sum(part.numel() * part.element_size() for part in flat)
        if size > self.max_bytes or key in self._rows:
            return
        while self.bytes + size > self.max_bytes:  # first, so that a freed pinned block can take the new rows
            _, evicted = self._rows.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()
        on_gpu = flat[0].is_cuda
        rows_of = [len(part) for part in flat]
        host = torch.empty(sum(rows_of), flat[0].shape[1], dtype=flat[0].dtype, pin_memory=on_gpu)
        for part, into in zip(flat, host.split(rows_of), strict=True):
            into.copy_(part, non_blocking=on_gpu)
        self._rows[key] = host
        self.bytes += size

    def stats(self) -> dict[str, int]:
        return {
            "encoder_cache_hits": self.hits,
            "encoder_cache_misses": self.misses,
            "encoder_cache_bytes": self.bytes,
        }
