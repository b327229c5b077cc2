"""A realtime session's input audio buffer: the user's audio as the client appends it, server VAD over the stream
everything appended forms, and the edges of the user's turns it finds there.

A speech start drops the buffer's audio before the start's padding and may cut the response under way short
(barge-in); a speech stop commits the turn and may answer it. What those do to the conversation and its
responses is the session's (`TurnEdges`). While the user speaks, the turn is prefilled as it grows
(`early.py`).
"""

from __future__ import annotations

import binascii
import time
from typing import Any, Protocol

import numpy as np
import pybase64

from omnistage.server.realtime.codecs import BadAudio, to_model_rate
from omnistage.server.realtime.conversation import Conversation, new_id
from omnistage.server.realtime.early import EarlyPrefill
from omnistage.server.realtime.link import Link
from omnistage.server.realtime.protocol import SessionError
from omnistage.server.realtime.settings import Settings
from omnistage.server.vad import SpeechDetector, VadEvent, VadSettings

# The most audio one buffer (one user turn) holds: what the audio encoder reads of one clip.
MAX_BUFFER_SECONDS = 300
# OpenAI refuses to commit less than this much audio.
MIN_COMMIT_MS = 100


class TurnEdges(Protocol):
    """What a session does at the edges of the user's turns that server VAD finds."""

    async def send(self, event: dict[str, Any]) -> None: ...

    async def interrupt(self) -> None:
        """The user began to speak over the response under way: it is cut short."""

    async def end_turn(self, respond: bool) -> None:
        """The user stopped: the buffer's audio is committed and, with `respond`, answered."""


class InputBuffer:
    """One session's input audio buffer, at the input format's rate, and server VAD over its stream."""

    def __init__(self, link: Link, session: TurnEdges) -> None:
        self.session = session
        self.chunks: list[np.ndarray] = []
        self.buffered = 0  # samples in the buffer
        self.streamed = 0  # samples appended since the session began (server VAD's clock)
        self.detector: SpeechDetector | None = None
        self.detector_origin_ms = 0  # where the detector's clock starts in the stream
        self.next_item = new_id("item")  # the id the buffer's audio will have once committed
        self.early = EarlyPrefill(link)  # the turn prefilled as it is spoken
        self.speaking = False  # server VAD: between a speech start and its stop
        self.speech_ended: float | None = None  # when the user's turn last ended, for latency

    def detect(self, settings: Settings) -> None:
        """Server VAD over the stream from here on, at its rate, with `settings`' turn detection (none: off)."""
        detection = settings.turn_detection
        if detection is None:
            self.detector = None
            return
        vad = VadSettings(detection.threshold, detection.prefix_padding_ms, detection.silence_duration_ms)
        self.detector_origin_ms = settings.input_format.ms(self.streamed)
        self.detector = SpeechDetector(vad, settings.input_format.rate)

    async def append(self, audio: str, settings: Settings, conversation: Conversation) -> None:
        """`input_audio_buffer.append`'s base64 `audio`, in `settings`' input format, into the buffer; the turn
        edges it completes are the session's to act on, and a turn under way is prefilled as far as it goes."""
        try:
            data = pybase64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise SessionError("audio: not base64", "invalid_value", "audio") from None
        fmt = settings.input_format
        try:
            samples = fmt.decode(data)
        except BadAudio as exc:
            raise SessionError(f"audio: {exc}", "invalid_value", "audio") from None
        if self.buffered + len(samples) > fmt.samples(MAX_BUFFER_SECONDS * 1000):
            raise SessionError(
                f"the input audio buffer holds {fmt.ms(self.buffered) / 1000:.1f} s; this append of "
                f"{fmt.ms(len(samples)) / 1000:.1f} s would pass the limit of {MAX_BUFFER_SECONDS} s a turn "
                "(commit, or clear it)",
                "input_audio_buffer_full",
                "audio",
            )
        self.chunks.append(samples)
        self.buffered += len(samples)
        self.streamed += len(samples)
        if self.detector is not None:
            for event in await self.detector.feed_in_thread(samples):
                await self._edge(event, settings)
        if settings.kind == "realtime" and (self.speaking or settings.turn_detection is None):

            def head(seconds: float) -> np.ndarray:
                return np.concatenate(self.chunks)[: fmt.samples(round(seconds * 1000))]

            self.early.grown(fmt.ms(self.buffered) / 1000, settings, conversation, head, fmt.rate)

    async def _edge(self, event: VadEvent, settings: Settings) -> None:
        """Server VAD saw the user start or stop: a start interrupts the response under way (barge-in) and
        drops the buffer's audio before the start's padding; a stop commits the turn and answers it."""
        detection = settings.turn_detection
        assert detection is not None  # a detector runs only with turn detection on
        at_ms = self.detector_origin_ms + event.audio_ms  # in the session's input stream
        self.speaking = event.kind == "speech_started"
        if self.speaking:
            self._keep_from(settings.input_format.samples(at_ms))
            await self.session.send(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": at_ms,
                    "item_id": self.next_item,
                }
            )
            if detection.interrupt_response:
                await self.session.interrupt()
            return
        await self.session.send(
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": at_ms, "item_id": self.next_item}
        )
        self.speech_ended = time.monotonic()
        if settings.input_format.ms(self.buffered) >= MIN_COMMIT_MS:
            await self.session.end_turn(detection.create_response)

    def _keep_from(self, start: int) -> None:
        """Drop the buffer's samples before stream position `start`."""
        drop = min(max(start - (self.streamed - self.buffered), 0), self.buffered)
        if drop:
            audio = np.concatenate(self.chunks)[drop:]
            self.chunks, self.buffered = [audio], len(audio)
        self.early.restart()

    def clear(self) -> None:
        self.chunks, self.buffered = [], 0
        self.early.restart()
        if self.detector is not None:
            self.detector.reset()

    def take(self, settings: Settings) -> tuple[str, np.ndarray]:
        """The buffer's audio as the user's next item: its id, and its clip at the model's rate. The buffer is
        empty after. Raises SessionError where it holds less than a commit needs."""
        fmt = settings.input_format
        if fmt.ms(self.buffered) < MIN_COMMIT_MS:
            raise SessionError(
                f"the input audio buffer holds {fmt.ms(self.buffered)} ms of audio; a commit needs at least "
                f"{MIN_COMMIT_MS} ms",
                "input_audio_buffer_commit_empty",
            )
        clip = to_model_rate(np.concatenate(self.chunks), fmt.rate)
        self.clear()
        if settings.turn_detection is None:
            self.speech_ended = time.monotonic()
        item_id, self.next_item = self.next_item, new_id("item")
        return item_id, clip

    async def close(self) -> None:
        await self.early.close()
