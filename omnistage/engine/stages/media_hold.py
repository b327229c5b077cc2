"""The encoder rows a text stage holds on its device, within what its memory plan kept room for.

The plan's floor keeps room for encoder rows beside every tower call and prefill step (memory/floor.py):
`--encoder-rows-mib`, or the largest media request's rows where those are more. That is the hold's `limit`
(`EncoderStage.rows_limit`, measured at start on a GPU; None: no limit, as on the CPU). Were every request's
media encoded as it arrived, a queue of long videos would hold all their rows at once. So the requests with media wait here in arrival order (`waiting`), unencoded on the host, and are
encoded while their rows fit what is left of the limit (`take`); one whose rows alone pass it is encoded when
nothing else is held. A request's rows leave the device once its prefill has passed its last media row
(`release`, after each step is queued): the kernels already queued that read them still do (the allocator
reuses a block only for work queued after its release), and a copy on the host (the prefix keys' where it was
made, else a copy queued behind those kernels) stays in the request's state for a preemption, dropped with
it at its end. A preempted request recomputes its prompt; its rows come back within the same limit before it
is readmitted (`restore`, `ready`). A request's rows count from its queueing to its prefill's passing them or
its end: a constrained request's rows, held while its grammar compiles (constrained.py; milliseconds for most
schemas), count once it is queued.

Images and videos are also encoded no further ahead of the prefill than `ahead_vision_rows` (two steps' tokens)
of vision rows it has not reached: eight 10 s videos fit the limit together, and encoded together each one's
prefill waited for all eight towers (~0.1 s a video on an H100); taken two steps ahead, the first video's
prefill follows its own tower, and the next is encoded while the prefill nears the end of the one before. The
vision tower's calls are pieces of a bounded size whatever is taken, so fewer at once costs no width; clips
alone are taken as before, their audio tower's ragged batches wider for many clips at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from omnistage.engine.sequence import Sequence
from omnistage.engine.stages.encoders import MultimodalEmbeds
from omnistage.engine.stages.host_rows import to_host
from omnistage.models.multimodal import MultimodalInputs

R = TypeVar("R")  # a request waiting for its encoding


@dataclass
class _Held:
    bytes: int
    end: int  # the prompt position after its last media row
    vision_at: np.ndarray  # the prompt positions of its vision rows, ascending


def rows_bytes(mm: MultimodalEmbeds) -> int:
    """Bytes of a prompt's encoder rows on the device (audio, vision and the vision's deepstack levels)."""
    return _bytes(_rows(mm))


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def media_rows(mm: MultimodalInputs) -> tuple[int, int]:
    """The audio rows and the vision rows (images' and videos') a prompt's media encode to."""
    return sum(mm.num_audio_tokens), sum(mm.num_image_tokens) + sum(mm.num_video_tokens)


def _rows(mm: MultimodalEmbeds) -> tuple[torch.Tensor | None, ...]:
    return mm.audio_embeds, mm.image_embeds, mm.deepstack


def _media_end(mm: MultimodalEmbeds) -> int:
    ends = [int(rows[-1]) + 1 for rows in (mm.audio_rows_host, mm.image_rows_host) if len(rows)]
    return max(ends, default=0)


class MediaHold(Generic[R]):
    """The encoder rows on one device: the requests waiting to be encoded and the sequences holding rows."""

    def __init__(self, limit: int | None = None, ahead_vision_rows: int | None = None) -> None:
        self.limit = limit
        self.ahead_vision_rows = ahead_vision_rows
        self.held_bytes = 0
        self._reserved_vision_rows = 0  # encoded for requests not yet queued
        self.waiting: deque[tuple[R, MultimodalInputs]] = deque()
        self._held: dict[Sequence[Any], _Held] = {}
        # bytes of one row, per kind, as the encoders gave them (unknown: such a request waits for an empty hold)
        self._row_bytes: dict[str, float] = {}

    def __len__(self) -> int:
        """The requests waiting to be encoded."""
        return len(self.waiting)

    def estimate(self, mm: MultimodalInputs) -> float:
        """The bytes a prompt's media will hold on the device (infinite before such rows were seen)."""
        audio, vision = media_rows(mm)
        return sum(
            n * self._row_bytes.get(kind, float("inf"))
            for kind, n in (("audio", audio), ("vision", vision))
            if n
        )

    def _fits(self, size: float) -> bool:
        return self.limit is None or self.held_bytes == 0 or self.held_bytes + size <= self.limit

    def take(self) -> list[R]:
        """The longest run of waiting requests, first ones first, whose rows fit the hold together and whose
        vision rows with those held that the prefill has not reached stay within `ahead_vision_rows` (one
        request at least, where none are): to encode now (each then `hold`s its rows)."""
        taken: list[R] = []
        planned, planned_vision = 0.0, 0
        held_vision = self.vision_rows_ahead() if self.ahead_vision_rows is not None else 0
        while self.waiting:
            request, mm = self.waiting[0]
            size, vision = self.estimate(mm), media_rows(mm)[1]
            if taken and self.limit is not None and self.held_bytes + planned + size > self.limit:
                break
            if not taken and not self._fits(size):
                break
            ahead = held_vision + planned_vision
            if (
                vision
                and ahead
                and self.ahead_vision_rows is not None
                and ahead + vision > self.ahead_vision_rows
            ):
                break
            self.waiting.popleft()
            taken.append(request)
            planned += size
            planned_vision += vision
        return taken

    def drop(self, request: R) -> bool:
        """Take a waiting request out (aborted); whether it was waiting."""
        for i, (waiting, _) in enumerate(self.waiting):
            if waiting is request:
                del self.waiting[i]
                return True
        return False

    def learn(self, mm: MultimodalInputs, embeds: MultimodalEmbeds) -> None:
        """Bytes per row of each kind, from a prompt's encoded rows."""
        audio, vision = media_rows(mm)
        if audio and embeds.audio_embeds is not None:
            self._row_bytes["audio"] = embeds.audio_embeds.element_size() * embeds.audio_embeds[0].numel()
        if vision and embeds.image_embeds is not None:
            per_row = embeds.image_embeds[0].numel() * embeds.image_embeds.element_size()
            levels = embeds.deepstack.shape[0] if embeds.deepstack is not None else 0
            self._row_bytes["vision"] = per_row * (1 + levels)

    def hold(self, seq: Sequence[Any], mm: MultimodalEmbeds | None) -> None:
        """`seq` holds its prompt's rows `mm` on the device from now on."""
        if mm is None or seq in self._held:
            return
        size = rows_bytes(mm)
        if size:
            self._held[seq] = _Held(size, _media_end(mm), mm.image_rows_host)
            self.held_bytes += size

    def reserve(self, mm: MultimodalEmbeds, count: bool = True) -> None:
        """Count (or, not `count`, stop counting) rows encoded for a request not yet queued: the request's
        sequence `hold`s them once it is."""
        sign = 1 if count else -1
        self.held_bytes += sign * rows_bytes(mm)
        self._reserved_vision_rows += sign * len(mm.image_rows_host)

    def vision_rows_ahead(self) -> int:
        """The vision rows on the device that the prefill has not reached yet."""
        held = sum(
            len(h.vision_at) - int(np.searchsorted(h.vision_at, seq.num_computed_tokens))
            for seq, h in self._held.items()
            if len(h.vision_at)
        )
        return held + self._reserved_vision_rows

    @property
    def holding(self) -> bool:
        """Some sequence holds rows on the device."""
        return bool(self._held)

    def release(self) -> None:
        """After a step is queued: release the rows whose prefill has passed them, and count none for the
        sequences that ended (their state drops its rows)."""
        for seq, held in list(self._held.items()):
            if seq.is_finished or seq.num_computed_tokens >= held.end:
                del self._held[seq]
                self.held_bytes -= held.bytes
                if not seq.is_finished and seq.data.mm is not None:
                    seq.data.mm = _offloaded(seq.data.mm)

    def needs_restore(self, waiting: Iterable[Sequence[Any]]) -> bool:
        """Some sequence of `waiting` (a preempted one) has its rows on the host and a prompt to compute."""
        return any(not self.ready(seq) for seq in waiting)

    def restore(self, waiting: Iterable[Sequence[Any]], device: torch.device) -> None:
        """Bring back the rows of the preempted sequences in `waiting`, first ones first, while they fit the
        hold (`ready` keeps the others out of a step)."""
        self.release()
        for seq in waiting:
            if self.ready(seq):
                continue
            mm = seq.data.mm
            size = _bytes(mm.offloaded)
            if not self._fits(size):
                return
            audio, image, deepstack = (
                None if t is None else t.to(device, non_blocking=True) for t in mm.offloaded
            )
            seq.data.mm = replace(
                mm, audio_embeds=audio, image_embeds=image, deepstack=deepstack, offloaded=None
            )
            self._held[seq] = _Held(size, _media_end(mm), mm.image_rows_host)
            self.held_bytes += size

    def ready(self, seq: Sequence[Any]) -> bool:
        """Whether `seq` may run a step: a sequence whose prompt is still to be computed has its rows."""
        return not _off(seq) or seq.num_computed_tokens >= _media_end(seq.data.mm)


def _off(seq: Sequence[Any]) -> bool:
    mm = seq.data.mm
    return mm is not None and mm.offloaded is not None


def _offloaded(mm: MultimodalEmbeds) -> MultimodalEmbeds:
    """`mm` with its rows on the host only: the audio and vision rows as the prefix keys' copies hold them,
    where they do (host_rows.py)."""
    host = mm.host_rows
    audio, image = (host.audio, host.image) if host is not None else (None, None)
    return replace(
        mm,
        audio_embeds=None,
        image_embeds=None,
        deepstack=None,
        offloaded=(
            audio if audio is not None else to_host(mm.audio_embeds),
            image if image is not None else to_host(mm.image_embeds),
            to_host(mm.deepstack),
        ),
    )
