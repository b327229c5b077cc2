"""What one forward step tells the attention backend about its flat batch of new tokens.

The batch is ragged: sequence b owns rows `query_start_loc[b]:query_start_loc[b+1]` of q/k/v, which are
its last `n_b` context positions (`seq_lens[b] - n_b` onwards). Its K/V live in pages
`block_tables[b]`; a token at position p sits in slot `page * page_size + p % page_size` of page
`block_tables[b][p // page_size]`. The KV cache of one layer is `[2, num_pages, page_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host-built tensor on `device`. To a GPU through pinned memory and without blocking: a copy from
    pageable memory first waits for all the work queued on the stream, so the host could not prepare a step
    while the GPU runs the previous one."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def cat_to_device(parts: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """`torch.cat(parts)` on `device`. From the host to a GPU, catted straight into a pinned buffer and copied
    without blocking (as `to_device`): a step's pixels are its largest input, and a pageable copy of them would
    wait for every step queued before it."""
    device = torch.device(device)
    if device.type != "cuda" or parts[0].device.type != "cpu":
        return torch.cat(list(parts)).to(device)
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    host = torch.empty(shape, dtype=parts[0].dtype, pin_memory=True)
    return torch.cat(list(parts), out=host).to(device, non_blocking=True)


def to_device_together(hosts: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host-built tensors on `device` through one copy: to a GPU their bytes are packed into one pinned buffer,
    copied without blocking (as `to_device`) and viewed back as each tensor, where a copy per tensor would
    cost a pinned allocation and a copy launch each."""
    device = torch.device(device)
    if device.type == "cpu":
        return [host.to(device) for host in hosts]
    return _through_one_buffer(hosts, device, pin=device.type == "cuda")


# Where each tensor starts in the buffer, in bytes: Triton specializes a kernel on whether each pointer is
# 16-byte aligned, so a tensor starting wherever the previous one ended would need a new build mid-request
# whenever a step's sizes moved it.
ALIGN = 16
_PADDING = torch.zeros(ALIGN, dtype=torch.uint8)


def _through_one_buffer(hosts: Sequence[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    if not hosts:
        return []
    pieces, offsets, size = [], [], 0
    for host in hosts:
        pad = -size % ALIGN
        if pad:
            pieces.append(_PADDING[:pad])
        offsets.append(size + pad)
        piece = _as_bytes(host)
        pieces.append(piece)
        size += pad + piece.numel()
    packed = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    on_device = torch.cat(pieces, out=packed).to(device, non_blocking=pin)
    return [
        on_device[offset : offset + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        for host, offset in zip(hosts, offsets)
    ]


def _as_bytes(host: torch.Tensor) -> torch.Tensor:
    """The bytes of `host` as a flat uint8 tensor (an empty one may have stride 0, which `view` refuses)."""
    if not host.numel():
        return torch.empty(0, dtype=torch.uint8)
    return host.contiguous().view(-1).view(torch.uint8)


class Chunk(NamedTuple):
    """One sequence's share of a step: `num_new` tokens at positions `start`.. , its pages in order."""

    start: int
    num_new: int
    pages: Sequence[int]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: flat KV slot of each row; -1 = padding, not written
    query_start_loc: torch.Tensor  # int32 [B+1]: cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new); 0 = padding sequence
    block_tables: torch.Tensor  # int32 [B, max_pages]: page ids, padded with 0
    max_query_len: int
    max_seq_len: int
    # every sequence's keys together (the sum of seq_lens), for a backend that gathers them from their pages
    # (`engine/attention/long_prefill.py`); 0 where unknown or padded (a graph's static metadata)
    num_keys: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(
        cls,
        chunks: Sequence[Chunk | tuple[int, int, Sequence[int]]],
        page_size: int,
        device: torch.device | str = "cpu",
        *,
        pad_seqs: int = 0,
        pad_rows: int = 0,
        max_pages: int | None = None,
    ) -> AttentionMetadata:
        """Metadata for `chunks` (start position, new tokens, page ids per sequence), built on the host and
        moved to `device` in one copy (`to_device` moves other tensors with it).

        `pad_seqs` appends sequences of one row each with seq_len 0 (a padded decode batch); `pad_rows`
        appends rows that belong to no sequence (a padded token count). Both write nothing and read zeros.
        `max_pages` fixes the block-table width (a graph's static shape); by default it is the widest need.
        """
        slots: list[int] = []
        starts, seq_lens, tables = [0], [], []
        for start, num_new, pages in chunks:
            seq_len = start + num_new
            if start < 0 or num_new < 0:
                raise ValueError(f"chunk start {start} and num_new {num_new} must be non-negative")
            if -(-seq_len // page_size) > len(pages):
                raise ValueError(
                    f"{seq_len} tokens need {-(-seq_len // page_size)} pages of {page_size}, got {len(pages)}"
                )
            slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, seq_len)]
            starts.append(starts[-1] + num_new)
            seq_lens.append(seq_len)
            tables.append(pages)
        for _ in range(pad_seqs):
            slots.append(-1)
            starts.append(starts[-1] + 1)
            seq_lens.append(0)
            tables.append(())
        slots += [-1] * pad_rows
        width = max([len(t) for t in tables] + [1]) if max_pages is None else max_pages
        if any(len(t) > width for t in tables):
            raise ValueError(f"a sequence holds more than max_pages={width} pages")
        # numpy turns lists of ints into arrays several times faster than torch.tensor does
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = table
        meta = cls(
            slot_mapping=torch.from_numpy(np.array(slots, dtype=np.int64)),
            query_start_loc=torch.from_numpy(np.array(starts, dtype=np.int32)),
            seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
            block_tables=torch.from_numpy(block_tables),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])) if seq_lens else 0,
            max_seq_len=max(seq_lens, default=0),
            num_keys=0 if pad_seqs or pad_rows else sum(seq_lens),
        )
        return meta if torch.device(device).type == "cpu" else meta.to_device(device)[0]

    def to_device(
        self, device: torch.device | str, *tensors: torch.Tensor
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """This host-built metadata on `device`, and `tensors` with it, in one copy (`to_device_together`)."""
        fields = (self.slot_mapping, self.query_start_loc, self.seq_lens, self.block_tables)
        moved = to_device_together([*fields, *tensors], device)
        meta = replace(
            self,
            slot_mapping=moved[0],
            query_start_loc=moved[1],
            seq_lens=moved[2],
            block_tables=moved[3],
        )
        return meta, moved[len(fields) :]
