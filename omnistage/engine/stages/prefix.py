"""A text stage's prefix-cache keys of a request (prefix_keys.py): its ids, its M-RoPE positions and the bytes
of its encoder rows, brought to the host once at admission."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from omnistage.engine.prefix_keys import MediaRows, page_keys

if TYPE_CHECKING:
    from omnistage.engine.stages.encoders import MultimodalEmbeds
    from omnistage.engine.stages.token_runner import HiddenTap
    from omnistage.models.layers.rotary import PromptPositions


def request_keys(
    token_ids: list[int],
    page_size: int,
    mrope: PromptPositions | None,
    mm: MultimodalEmbeds | None,
    unkept_tap: HiddenTap | None,
) -> list[bytes]:
    """The keys of the prompt's full pages that may be cached. `unkept_tap`: a tap whose hidden states the
    runner does not keep beside the pages (TokenRunner.keep_taps); only the pages before its first row may
    then be cached, since a later stage reads those rows and only computing them writes them."""
    num_pages = len(token_ids) // page_size
    if unkept_tap is not None and len(unkept_tap.rows_host):
        num_pages = min(num_pages, int(unkept_tap.rows_host[0]) // page_size)
    if num_pages == 0:
        return []
    positions = mrope.positions.numpy() if mrope is not None else None
    return page_keys(token_ids, page_size, num_pages, positions, _media(mm) if mm is not None else ())


def _media(mm: MultimodalEmbeds) -> tuple[MediaRows, ...]:
    """The audio rows and the vision rows as bytes per placeholder on the host, each tensor copied there as it
    is: a layout on the device would allocate at admission, outside the memory plan."""
    media = []
    if mm.audio_embeds is not None:
        media.append(MediaRows(mm.audio_rows_host, _bytes(mm.audio_embeds)))
    if mm.image_embeds is not None:
        media.append(MediaRows(mm.image_rows_host, _bytes(mm.image_embeds)))
    return tuple(media)


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """`[n, H]` rows as `[n, H * itemsize]` bytes on the host (numpy)."""
    return rows.detach().to("cpu").contiguous().view(torch.uint8).numpy()
