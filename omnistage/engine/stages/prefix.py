"""A text stage's prefix-cache keys of a request (prefix_keys.py): its ids, its M-RoPE positions and the bytes
of its encoder rows, brought to the host once at admission (host_rows.py); the pages its sampled ids fill are
keyed on them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from omnistage.engine.prefix_keys import MediaRows, PageKeys
from omnistage.engine.stages.host_rows import copy_rows

if TYPE_CHECKING:
    from omnistage.engine.stages.encoders import MultimodalEmbeds
    from omnistage.engine.stages.token_runner import HiddenTap, TokenRunner
    from omnistage.request import GenerationRequest


def request_keys(
    request: GenerationRequest, mm: MultimodalEmbeds | None, tap: HiddenTap | None, runner: TokenRunner
) -> PageKeys:
    """The keys of the full pages of the request's prompt (its media's encoder rows `mm`) on `runner`'s pages,
    and what keys the pages its sampled ids fill. A `tap` whose hidden states the runner keeps beside its pages
    (TokenRunner.keep_taps) names the pages it reads them from: only pages whose rows were all prefilled are
    given to it. One whose states the runner does not keep lets no page from its first row's on be cached,
    since a later stage reads those rows and only computing them writes them."""
    page_size = runner.page_size
    end, reads_kept_rows = None, frozenset[int]()
    if tap is not None and len(tap.rows_host):
        if _kept(tap, runner):
            reads_kept_rows = frozenset((tap.rows_host // page_size).tolist())
        else:
            end = int(tap.rows_host[0]) // page_size
    elif mm is not None and runner.keep_taps:
        # A prompt that reads no tap takes a page decode steps computed in part only where it holds no media
        # row either: such a page's tail holds no kept rows, so a spoken turn (which reads them at every media
        # row) cannot take it; computed again here, it is one that turn can (kv_cache.py). A realtime turn's
        # early prefill is such a prompt, and the turn's response then finds everything it prefilled.
        media_rows = np.concatenate([mm.audio_rows_host, mm.image_rows_host])
        reads_kept_rows = frozenset((media_rows // page_size).tolist())
    mrope = request.mrope
    positions, delta = (mrope.positions.numpy(), mrope.delta) if mrope is not None else (None, 0)
    media = _media(mm) if mm is not None and end != 0 else ()
    return PageKeys.of_prompt(
        request.prompt_token_ids, page_size, positions, delta, media, end, reads_kept_rows
    )


def _kept(tap: HiddenTap, runner: TokenRunner) -> bool:
    """Whether the runner keeps the tap's rows beside its pages, for a prompt taking them from the cache."""
    return runner.keep_taps and tap.layer == runner.tap_layer


def _media(mm: MultimodalEmbeds) -> tuple[MediaRows, ...]:
    """The audio rows and the vision rows as bytes per placeholder on the host, each tensor copied there as it
    is (a layout on the device would allocate at admission, outside the memory plan): the copies the admission
    made without waiting (host_rows.py), else copies made now, which wait for the work queued on the stream."""
    host = mm.host_rows if mm.host_rows is not None else copy_rows(mm.audio_embeds, mm.image_embeds)
    host.wait()
    media = []
    if host.audio is not None:
        media.append(MediaRows(mm.audio_rows_host, _bytes(host.audio)))
    if host.image is not None:
        media.append(MediaRows(mm.image_rows_host, _bytes(host.image)))
    return tuple(media)


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """`[n, H]` rows as `[n, H * itemsize]` bytes on the host (numpy)."""
    return rows.detach().contiguous().view(torch.uint8).numpy()
