"""A text stage's requests from their arrival to its scheduler's queue: checked against the model and the pool
(admission.py), their media encoded as far as the device's encoder rows allow (media_hold.py) and, for the
prefix keys, their rows copied to the host without waiting (host_rows.py), their constraints compiled
(constrained.py); a request that fails on the way ends with its error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from omnistage.engine.output_processor import RequestState, request_output
from omnistage.engine.scheduler import Scheduler
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.engine.stages.admission import encode_media
from omnistage.engine.stages.constrained import Constraints
from omnistage.engine.stages.encoders import EncoderStage, MultimodalEmbeds
from omnistage.engine.stages.host_rows import copy_rows
from omnistage.engine.stages.media_hold import MediaHold
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.outputs import RequestOutput
from omnistage.request import SamplingParams

if TYPE_CHECKING:
    from omnistage.engine.structured import GrammarState

log = logging.getLogger(__name__)


@dataclass
class Parked:
    """An admitted request before it is queued: its encoder outputs (None before its media are encoded, or
    without media), effective max_tokens and metrics."""

    request: NewRequest
    mm: MultimodalEmbeds | None
    max_tokens: int
    metrics: dict[str, float]


class TextAdmission:
    """The requests of one text stage not yet in its scheduler's queue, and the encoder rows on its device."""

    def __init__(
        self,
        stage: str,
        scheduler: Callable[[], Scheduler[RequestState]],
        encoders: EncoderStage,
        constraints: Constraints[Parked],
        validate: Callable[[list[int], SamplingParams], int],
        sequence_of: Callable[[Parked, GrammarState | None], Sequence[RequestState]],
        device: torch.device,
        keys_media: bool = False,
    ) -> None:
        """`scheduler` gives the stage's scheduler (made with its pages); `validate` a request's effective
        max_tokens, or raises what makes it unservable; `sequence_of` makes a parked request's sequence;
        `keys_media`: the sequences' prefix keys read their encoder rows on the host."""
        self.stage, self._scheduler, self.encoders, self.constraints = stage, scheduler, encoders, constraints
        self.validate, self.sequence_of, self.device = validate, sequence_of, device
        self.keys_media = keys_media
        self.media: MediaHold[Parked] = MediaHold()
        self._failures: list[tuple[Parked, Exception]] = []  # encodings failed after their add: end next turn
        self._copying: list[Parked] = []  # encoded, their rows on their way to the host (host_rows.py)

    @property
    def scheduler(self) -> Scheduler[RequestState]:
        return self._scheduler()

    def __len__(self) -> int:
        """The requests admitted but not yet queued (waiting for their encoding, their rows' copy or their
        compile, or to end with their encoding's error)."""
        return len(self.media) + len(self._copying) + len(self.constraints.compiling) + len(self._failures)

    def add(self, requests: list[NewRequest]) -> list[Exception | None]:
        """Admit several requests; their media go through the encoders together (one ragged batch per tower) as
        far as the encoder rows allow, the others later, in arrival order. Returns, per request, None or the
        exception that kept it out; the others are admitted. A request its pipeline validated
        (`NewRequest.of`) is not checked again."""
        arrival = time.monotonic()
        errors: list[Exception | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            try:
                max_tokens = (
                    r.max_tokens if r.max_tokens is not None else self.validate(r.prompt_token_ids, r.params)
                )
                if r.params.structured is not None:
                    Constraints.check(r.params.structured)
            except Exception as exc:
                errors[i] = exc
                continue
            parked = Parked(r, None, max_tokens, {"arrival": arrival})
            if r.mm is None:
                self._queue(parked)
            else:
                self.media.waiting.append((parked, r.mm))
        failed = dict(self._encode_waiting())
        for i, r in enumerate(requests):
            if r.request_id in failed:
                errors[i] = failed.pop(r.request_id)[1]
        self._failures += failed.values()  # earlier requests'
        return errors

    def turn(self) -> list[RequestOutput]:
        """Before a step: queue the requests whose constraints compiled, bring back the rows of preempted
        requests, encode the waiting requests' media as far as the rows allow; end those that failed."""
        failed = self._admit_compiled() if len(self.constraints.compiling) else []
        if self._copying:
            self._queue_copied()
        if self.media.needs_restore(self.scheduler.waiting):
            self.media.restore(self.scheduler.waiting, self.device)
        if not (self.media.waiting or self._failures):
            return failed
        failures, self._failures = self._failures, []
        failures += [failure for _, failure in self._encode_waiting()]
        return failed + [self._end_failed(parked, None, exc) for parked, exc in failures]

    def abort(self, request_id: str) -> bool:
        """Drop a request that is not yet queued; whether it was here."""
        if self.constraints.compiling.abort(request_id):
            return True
        copying = next((p for p in self._copying if p.request.request_id == request_id), None)
        if copying is not None:
            self._copying.remove(copying)
            assert copying.mm is not None
            self.media.reserve(copying.mm, count=False)
            return True
        unencoded = next((p for p, _ in self.media.waiting if p.request.request_id == request_id), None)
        return unencoded is not None and self.media.drop(unencoded)

    def _encode_waiting(self) -> list[tuple[str, tuple[Parked, Exception]]]:
        """Encode the requests waiting for their media while their rows fit, and queue them; those whose
        encoding failed, by request id."""
        self.media.release()
        failed = []
        while taken := self.media.take():
            embeds = encode_media(self.encoders, {k: parked.request for k, parked in enumerate(taken)})
            encoded = time.monotonic()
            for k, parked in enumerate(taken):
                mm = embeds[k]
                if isinstance(mm, Exception):
                    failed.append((parked.request.request_id, (parked, mm)))
                    continue
                assert parked.request.mm is not None
                self.media.learn(parked.request.mm, mm)
                if self.keys_media:
                    mm = replace(mm, host_rows=copy_rows(mm.audio_embeds, mm.image_embeds))
                parked.mm, parked.metrics["encoded"] = mm, encoded
                if self._copying or (mm.host_rows is not None and not mm.host_rows.ready()):
                    self._copying.append(parked)  # queued in arrival order once copied
                    self.media.reserve(mm)
                else:
                    self._queue(parked)
        return failed

    def _queue_copied(self) -> None:
        """Queue the encoded requests whose rows have reached the host, in arrival order; where nothing else is
        queued or running (no step would overlap the copy), wait for the first one's copy."""
        if self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0:
            first = self._copying[0].mm
            assert first is not None and first.host_rows is not None
            first.host_rows.wait()
        while self._copying:
            mm = self._copying[0].mm
            assert mm is not None and mm.host_rows is not None
            if not mm.host_rows.ready():
                return
            self.media.reserve(mm, count=False)
            self._queue(self._copying.pop(0))

    def _queue(self, parked: Parked) -> None:
        """Queue a request whose media are encoded, or wait for its constraint's compile first."""
        parked.metrics.setdefault("encoded", parked.metrics["arrival"])
        structured = parked.request.params.structured
        if structured is not None and not self.constraints.compiled(structured):
            self.constraints.compiling.add(
                parked.request.request_id, structured, parked
            )  # queued once compiled
            return
        grammar = self.constraints.state(structured) if structured is not None else None
        seq = self.sequence_of(parked, grammar)
        self.scheduler.add(seq)
        self.media.hold(seq, parked.mm)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose constraints have compiled; end those whose compile failed."""
        failed = []
        for parked, grammar in self.constraints.compiling.ready():
            if isinstance(grammar, Exception):
                failed.append(self._end_failed(parked, None, grammar))
                continue
            seq = self.sequence_of(parked, grammar)
            try:
                self.scheduler.add(seq)
            except Exception as exc:
                failed.append(self._end_failed(parked, seq, exc))
                continue
            self.media.hold(seq, parked.mm)
        return failed

    def _end_failed(
        self, parked: Parked, seq: Sequence[RequestState] | None, exc: Exception
    ) -> RequestOutput:
        """A request that was never queued ends here, with its error."""
        seq = seq or self.sequence_of(parked, None)
        log.error("request %s failed in the %s stage", seq.request_id, self.stage, exc_info=exc)
        seq.data.error = f"{type(exc).__name__}: {exc}"
        seq.status = SequenceStatus.FINISHED_ERROR
        return request_output(seq, "", [])
