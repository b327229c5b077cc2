"""A text stage's prefix-cache keys of a request (prefix_keys.py): its ids, its M-RoPE positions and the bytes
of its encoder rows, brought to the host once at admission."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from omnistage.engine.prefix_keys import MediaRows, page_keys

if TYPE_CHECKING:
    from omnistage.engine.stages.encoders import MultimodalEmbeds
    from omnistage.engine.stages.token_runner import HiddenTap, TokenRunner
    from omnistage.request import GenerationRequest


def request_keys(
    request: GenerationRequest, mm: MultimodalEmbeds | None, tap: HiddenTap | None, runner: TokenRunner
) -> list[bytes]:
    """The keys of the full pages of the request's prompt (its media's encoder rows `mm`) that may be cached on
    `runner`'s pages. A `tap` whose hidden states the runner does not keep beside its pages
    (TokenRunner.keep_taps) lets only the pages before its first row be cached, since a later stage reads those
    rows and only computing them writes them."""
    token_ids, mrope, page_size = request.prompt_token_ids, request.mrope, runner.page_size
    num_pages = len(token_ids) // page_size
    if tap is not None and not _kept(tap, runner) and len(tap.rows_host):
        num_pages = min(num_pages, int(tap.rows_host[0]) // page_size)
    if num_pages == 0:
        return []
    positions = mrope.positions.numpy() if mrope is not None else None
    return page_keys(token_ids, page_size, num_pages, positions, _media(mm) if mm is not None else ())


def _kept(tap: HiddenTap, runner: TokenRunner) -> bool:
    """Whether the runner keeps the tap's rows beside its pages, for a prompt taking them from the cache."""
    return runner.keep_taps and tap.layer == runner.tap_layer


def _media(mm: MultimodalEmbeds) -> tuple[MediaRows, ...]:
    """The audio rows, and the vision rows with their deepstack levels, as bytes per placeholder on the host."""
    media = []
    if mm.audio_embeds is not None:
        media.append(MediaRows(mm.audio_rows_host, _bytes(mm.audio_embeds)))
    if mm.image_embeds is not None:
        vision = mm.image_embeds
        if mm.deepstack is not None:  # [levels, n, H] -> [n, levels * H] beside each row
            levels = mm.deepstack.to(vision.dtype).permute(1, 0, 2).reshape(vision.shape[0], -1)
            vision = torch.cat([vision, levels], dim=1)
        media.append(MediaRows(mm.image_rows_host, _bytes(vision)))
    return tuple(media)


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """`[n, H]` rows as `[n, H * itemsize]` bytes on the host (numpy)."""
    return rows.detach().contiguous().cpu().view(torch.uint8).numpy()
