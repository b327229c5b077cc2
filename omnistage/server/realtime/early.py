"""Prefilling a turn while the user speaks.

Each time the turn's audio grows by another whole window of the audio encoder (8 s: the tower attends within
windows of 800 mel frames of 10 ms, so a whole window's rows do not change as the clip grows), the conversation
with the turn so far is prefilled into the Thinker's prefix cache (`AsyncPipeline.prefill`). At the end of
speech only the pages after the last whole window remain to compute.

Exactness is the prefix cache's: a page is reused only where its key (ids, positions and the encoder rows'
bytes) is the whole turn's, so a window counts only if its rows are bit-identical to the whole turn's. They
are unless a louder sound later in the turn raises the log-mel floor (set from the clip's loudest frame); then
those pages are computed again at the end, as without this. The clip is cut a little past the window's end, so
that the window's last mel frames (whose STFT reads past it) and the resampler's last samples (its filter reads
ahead) are the whole turn's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from omnistage.request import GenerationRequest, SamplingParams
from omnistage.server.realtime.codecs import to_model_rate
from omnistage.server.realtime.conversation import Conversation, new_id
from omnistage.server.realtime.link import Link
from omnistage.server.realtime.settings import Settings
from omnistage.server.realtime.turns import lay_out

log = logging.getLogger(__name__)

WINDOW_S = 8.0  # the audio encoder's attention window (n_window_infer: 800 frames of 10 ms)
MARGIN_S = 0.1  # past the window: the STFT's half frame (12.5 ms) and the resampler's look-ahead (<20 ms)


class EarlyPrefill:
    """The prefills of one session's turns, one at a time."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.windows = 0  # whole windows of the current turn prefilled or under way
        self.task: asyncio.Task | None = None

    def restart(self) -> None:
        """A new turn: the input buffer was emptied or cut at a speech start."""
        self.windows = 0

    def grown(
        self,
        seconds: float,
        settings: Settings,
        conversation: Conversation,
        audio: Callable[[float], np.ndarray],
        rate: int,
    ) -> None:
        """The turn's audio grew to `seconds` (`audio(s)`: its first s seconds, at `rate`): past another whole
        window, and with no prefill under way, prefill the conversation with the turn's whole windows so far."""
        whole = int(max(seconds - MARGIN_S, 0.0) // WINDOW_S)
        if whole <= self.windows or (self.task is not None and not self.task.done()):
            return
        self.windows = whole
        messages, _ = conversation.messages(settings.instructions)  # snapshots, taken on the event loop
        turn = audio(whole * WINDOW_S + MARGIN_S)
        tools = list(settings.tools) or None

        def build() -> GenerationRequest:  # in a worker thread: the resampling, features and tokens
            clip = to_model_rate(turn, rate)
            messages.append({"role": "user", "content": [{"type": "audio", "audio": clip}]})
            frontend = self.link.pipeline.frontend
            prompt, ids, mrope, mm = lay_out(
                frontend.processor, frontend.max_model_len, messages, True, tools
            )
            return GenerationRequest(new_id("early"), ids, SamplingParams(max_tokens=1), prompt, mrope, mm)

        self.task = asyncio.ensure_future(self._run(build))

    async def _run(self, build: Callable[[], GenerationRequest]) -> None:
        try:
            await self.link.pipeline.prefill(await asyncio.to_thread(build))
        except Exception:  # it only warms the cache: a failure costs hits, and the turn itself will say why
            log.debug("a turn's early prefill failed", exc_info=True)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
