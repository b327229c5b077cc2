"""One step of Qwen3-Omni's stages: the Thinker's step, then the speaking step (`handoff.py`) on the text known
so far, in turn or, on a GPU with overlap_stages, beside each other (`side_stream.py`). A speaking request's text
comes from the Thinker's outputs; one that fails is stopped in every stage."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np
import torch

from omnistage.engine.stages.text import TextStage
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker_input import TtsEmbeds
from omnistage.outputs import RequestOutput
from omnistage.pipeline.handoff import Handoff, Speech
from omnistage.pipeline.qwen3_omni_speech import default_frame_cap, speech_output
from omnistage.pipeline.side_stream import SideStream
from omnistage.pipeline.speech_stages import SpeechStages

log = logging.getLogger(__name__)


class OmniStep:
    """The step over the Thinker and, where the pipeline speaks, the speech stages, with the hand-off between
    them (`handoff`) over `speaking` (the pipeline's dict of speaking requests, shared). `talker_tables`: the
    Talker's TTS embeddings and projected text rows (talker_input), where it speaks."""

    def __init__(
        self,
        thinker: TextStage,
        speech_stages: SpeechStages | None,
        speaking: dict[str, Speech],
        model_config: Qwen3OmniConfig,
        talker_tables: tuple[TtsEmbeds, torch.Tensor] | None,
        overlap: bool,
    ) -> None:
        self.thinker, self.speech_stages, self.speaking = thinker, speech_stages, speaking
        self.handoff: Handoff | None = None
        if speech_stages is not None:
            assert talker_tables is not None  # built with the speech stages
            tts, rows = talker_tables
            self.handoff = Handoff(
                speech_stages, tts, rows, model_config, speaking, self.fail, thinker.prefix_caching
            )
        # on a GPU the Thinker has a stream of its own, for its steps beside the speech stages' (`step`) when
        # overlap_stages is on (speech_profile.py times both ways)
        speaks_on_gpu = speech_stages is not None and thinker.device.type == "cuda"
        self._thinker_side = SideStream(thinker.device, "thinker") if speaks_on_gpu else None
        self.overlap = overlap
        if self.overlap and self._thinker_side is not None:
            self.thinker.decode_ahead = False  # its steps beside are overlapped already, on a thread
            log.warning(
                "overlap_stages: the Thinker's steps run beside the speech stages'; on an H200 with driver "
                "580.159.04 a process so run stalled for minutes (README, 'Speech out')"
            )
        self._deferred_aborts: list[str] | None = None  # while a Thinker step runs beside: aborts wait for it

    def step(self) -> list[RequestOutput]:
        """A Thinker step, then a speaking step on the text known so far. On a GPU, once every speaking request's
        Talker runs, the two run at once (`side_stream.py`), the Talker reading the text of the steps before:
        it is a step behind the Thinker anyway (row k is token k + 1). Before that, the Thinker's step comes
        first, so that a new request's Talker starts on its first token in the same step."""
        outputs: list[RequestOutput] = []
        touched: dict[str, Speech] = {}
        beside = None
        if self.thinker.has_unfinished():
            if self._beside():
                assert self._thinker_side is not None  # `_beside` says there is one
                self._deferred_aborts = []
                beside = self._thinker_side.submit(self.thinker.step)
            else:
                self._on_thinker(self._thinker_step(), outputs, touched)
        try:
            chunks = self._speak() if self.speaking else {}
        finally:  # the Thinker's step ends before anything else touches it, also when the speaking step raised
            thinker_outputs = self._join(beside) if beside is not None else []
        self._on_thinker(thinker_outputs, outputs, touched)
        for request_id, speech in self.speaking.items():
            if request_id in chunks or speech.finished:
                touched[request_id] = speech
        for request_id, speech in touched.items():
            outputs.append(speech_output(speech, chunks.get(request_id, [])))
            if speech.finished:
                self.speaking.pop(request_id, None)
        return outputs

    def fail(self, speech: Speech, error: str) -> None:
        """End a speaking request with `error` in every stage (the Thinker's abort waits for a step beside)."""
        assert self.speech_stages is not None  # a speaking request's failure
        speech.error = error
        if self._deferred_aborts is not None:  # the Thinker is mid-step on its thread
            self._deferred_aborts.append(speech.request_id)
        else:
            self.thinker.abort(speech.request_id)
        self.speech_stages.talker_stage.abort(speech.request_id)
        self.speech_stages.streamer.cancel(speech.request_id)

    def _join(self, beside: Future[list[RequestOutput]]) -> list[RequestOutput]:
        """The Thinker's step beside, then the aborts that waited for it (also when it raised)."""
        assert self._thinker_side is not None
        try:
            return self._thinker_side.join(beside)
        finally:
            aborts, self._deferred_aborts = self._deferred_aborts, None
            for request_id in aborts or []:
                self.thinker.abort(request_id)

    def _beside(self) -> bool:
        """Whether this step's Thinker step runs beside the speaking step: every Talker has started, and the
        Thinker's step replays a decode graph, which allocates little on the side stream (side_stream.py).
        Its eager steps (prefills) also call the layers torch.compile wraps, as the Talker's eager steps do:
        dynamo's caches of one code object are not entered from two threads."""
        return (
            self._thinker_side is not None
            and self.overlap
            and bool(self.speaking)
            and all(s.talker_started or s.error is not None for s in self.speaking.values())
            and self.thinker.replays_next_step()
        )

    def _thinker_step(self) -> list[RequestOutput]:
        outputs = self.thinker.step()
        if self._thinker_side is not None:  # a Thinker step beside starts after this one's KV writes
            self._thinker_side.mark()
        return outputs

    def _on_thinker(
        self, thinker_outputs: list[RequestOutput], outputs: list[RequestOutput], touched: dict[str, Speech]
    ) -> None:
        """A Thinker step's outputs: text-only ones go out as they are; a speaking request's update its text."""
        for out in thinker_outputs:
            speech = self.speaking.get(out.request_id)
            if speech is None:
                outputs.append(out)
                continue
            if speech.error is None:  # one failed meanwhile, in the speaking step beside, keeps its error
                self._on_text(speech, out)
            touched[out.request_id] = speech

    def _on_text(self, speech: Speech, out: RequestOutput) -> None:
        assert self.speech_stages is not None and self.handoff is not None  # a speaking request's text
        completion = out.outputs[0]
        speech.text = out
        speech.generated = completion.token_ids
        if not out.finished:
            return
        speech.text_done = True
        if completion.finish_reason in ("error", "abort"):
            self.fail(speech, out.error or f"the reply's text ended with {completion.finish_reason}")
            return
        if speech.params.talker.max_tokens is None:  # the cap follows the text, now that its length is known
            speech.frame_cap = min(speech.frame_cap, default_frame_cap(max(0, len(speech.generated) - 1)))
            if (
                speech.talker_started
                and not speech.talker_done
                and self.speech_stages.talker_stage.cap(speech.request_id, speech.frame_cap)
            ):
                self.handoff.end_talker(speech)

    def _speak(self) -> dict[str, list[np.ndarray]]:
        assert self.speech_stages is not None and self.handoff is not None  # requests speak
        with torch.inference_mode(), self.speech_stages.on_device():
            return self.handoff.step()
