"""The floor's phases: the measured eager peaks of the largest requests' steps, which the plan keeps room for
(`plan.StageMemory.peaks`)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.engine.memory.plan import MiB, Row


@dataclass(frozen=True)
class Floor:
    """Measured eager peaks beyond the weights of the phases of the largest requests, in bytes.

    The towers take one largest input per call (`*_encoder`: the peak of one call on the longest clip or the
    largest image the processor admits, its rows included). A request brings up to `audio_clips` such clips
    and `images` such images (what its context holds), encoded one call after another, and holds every
    one's rows (`*_outputs` each) while its prompt prefills in steps no larger than the largest text
    prefill step (`prefill`). The requests whose prefill has not passed their rows hold up to `rows_limit`
    bytes of them together (`rows_held`, or one largest request's where that is more: the stage's hold,
    engine/stages/media_hold.py), beside a tower's call (its own rows among them) and a prefill step. The
    floor is the largest phase.
    """

    prefill: int
    prefill_tokens: int = 0
    audio_encoder: int = 0
    audio_outputs: int = 0
    audio_clips: int = 1
    audio_seconds: float = 0.0
    vision_encoder: int = 0
    image_outputs: int = 0
    images: int = 1
    image_size: tuple[int, int] = (0, 0)  # width x height in pixels
    rows_held: int = 0  # bytes of encoder rows held at once, where more than one largest request's

    def _media(self) -> list[tuple[str, str, int, int, int, str]]:
        return [
            (kind, tower, peak, each, count, what)
            for kind, tower, peak, each, count, what in (
                (
                    "audio",
                    "audio encoder",
                    self.audio_encoder,
                    self.audio_outputs,
                    self.audio_clips,
                    f"{self.audio_seconds:g} s clip",
                ),
                (
                    "image",
                    "vision encoder",
                    self.vision_encoder,
                    self.image_outputs,
                    self.images,
                    f"{self.image_size[0]}x{self.image_size[1]} image",
                ),
            )  # fmt: skip
            if peak
        ]

    @property
    def rows_limit(self) -> int:
        """The encoder rows held at once: `rows_held`, or the largest request's where those are more."""
        return max([self.rows_held] + [count * each for _, _, _, each, count, _ in self._media()])

    def phases(self) -> list[Row]:
        """(name, bytes, what it runs on) of every phase measured."""
        rows = [("text prefill", self.prefill, f"{self.prefill_tokens:,} tokens")]
        limit = self.rows_limit
        for kind, tower, peak, each, count, what in self._media():
            held = max(count * each, self.rows_held)
            rows_note = f"{held / MiB:,.0f} MiB of encoder rows held"
            if held > count * each:
                note = f"with requests' {rows_note}"
            elif count == 1:
                note = f"with the {what}'s {rows_note}"
            else:
                note = f"with {count} x {what}: {rows_note}"
            beside = "" if limit == count * each else f", beside {limit / MiB:,.0f} MiB of rows held"
            rows += [
                (
                    tower,
                    peak - each + limit,
                    (what if count == 1 else f"{count} x {what}, one call each") + beside,
                ),
                (f"{kind} prefill", self.prefill + held, note),
            ]
        return rows

    @property
    def peak(self) -> int:
        return max(size for _, size, _ in self.phases())
