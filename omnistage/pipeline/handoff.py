"""The hand-off across Qwen3-Omni's stages, one speaking step at a time, by the rules of
`models/qwen3_omni/talker_input.py` (equal to transformers' offline `generate(return_audio=True)`):
- the Thinker keeps the hidden states after `accept_hidden_layer` layers at its prompt's media rows;
- the Thinker's last token is never spoken, and the Thinker knows a token is its last when it yields it (it
  finishes there): every token it yields unfinished is spoken. The Talker's prompt is built as soon as the
  first one is known, with the Thinker's first token;
- the Talker's decode step k reads text row k (spoken token k + 1, then tts_eos once, then tts_pad) and waits
  until the Thinker has yielded that token (or ended);
- the Talker's prompt pages that hold only user turns are keyed for its prefix cache where the Thinker's is on
  (`talker_prefix.py`): a conversation's next turn prefills its new user turn, not every turn again;
- every code 0 the Talker samples but codec EOS becomes a frame through the code predictor, whose 16-embedding
  sum plus the next text row is the Talker's next input; frames stream into Code2Wav, and its chunks go out
  with the request's outputs. A request finishes when its text and its audio have.
- so frame k is made having read min(k + 1, spoken) of the reply's text tokens (the prompt's one, then one per
  step): each frame goes out with that count once its audio has (`SpokenFrame`), which is what a client that
  stopped the audio at some point heard of the text.

Each speaking request's progress is a `Speech`; the pipeline (`qwen3_omni.py`) feeds it the Thinker's text and
builds the request's outputs, `Handoff.step` moves every speaking request on by one Talker step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from omnistage.engine.stages.host_rows import to_host
from omnistage.engine.stages.rows import InFlight, Sampled
from omnistage.engine.stages.token_runner import HiddenTap
from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.talker_input import PromptSource, TtsEmbeds, talker_positions, talker_prompts
from omnistage.outputs import RequestOutput, SpokenFrame
from omnistage.pipeline.audio_readback import AudioReadback
from omnistage.pipeline.speech_stages import PREDICTOR_TEMPERATURE, PREDICTOR_TOP_P, SpeechStages
from omnistage.pipeline.talker_prefix import talker_keys
from omnistage.request import SpeechParams

log = logging.getLogger(__name__)


@dataclass
class Speech:
    """One speaking request's progress across the stages."""

    request_id: str
    params: SpeechParams
    speaker: int
    prompt_ids: list[int]
    media: MediaLayout  # what the Talker's prompt positions need of the prompt's media
    frame_cap: int
    tap: HiddenTap | None
    text: RequestOutput  # the latest text-side output (the Thinker's, or the given reply's)
    generated: list[int] = field(default_factory=list)  # the Thinker's tokens so far
    text_done: bool = False
    talker_started: bool = False
    # the code predictor's draws: a function of (seed, draw number), see static_sampling
    predictor_seed: int = 0
    predictor_draws: int = 0
    rows_fed: int = 0  # the Talker's decode rows given so far = text rows consumed
    text_read: int = 0  # the reply's text tokens the Talker was given: its prompt's one, then rows'
    codec_sum: torch.Tensor | None = None  # the last frame's embedding sum, waiting for its text row
    codes: list[torch.Tensor] = field(default_factory=list)  # one [num_code_groups] row per frame
    frame_text: list[int] = field(default_factory=list)  # per frame: `text_read` when the Talker sampled it
    samples_out: int = 0  # the audio's samples out of Code2Wav so far
    spoken_frames: list[SpokenFrame] = field(default_factory=list)  # the frames whose audio is out
    frames_reported: int = 0  # of those, the ones the request's outputs have carried
    talker_done: bool = False
    audio: list[np.ndarray] = field(default_factory=list)
    audio_done: bool = False
    error: str | None = None
    first_audio: float = 0.0  # monotonic seconds of the first audio chunk

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.text_done and self.audio_done)

    @property
    def spoken(self) -> list[int]:
        """The reply's tokens known to be spoken: all the Thinker has yielded, but its last once it has ended."""
        return self.generated[:-1] if self.text_done else self.generated


@dataclass
class EarlyFrames:
    """Frames the code predictor computed on a Talker step's ids before they reached the host
    (`Handoff.launch_frames`): frames `[B, G]` and codec embedding sums `[B, H]`, and for each sampling row of
    the step that was predicted, its request and its row in them."""

    rows: dict[int, tuple[Speech, int]]
    codes: torch.Tensor
    sums: torch.Tensor

    def row_of(self, row: int, speech: Speech) -> int | None:
        """Where the step's sampling row `row` has its frame, if it was predicted for `speech`."""
        predicted, at = self.rows.get(row, (None, 0))
        return at if predicted is speech else None


class Handoff:
    """The speaking step over `speaking` (the pipeline's dict of speaking requests, shared): the Talker's prompt
    from the Thinker's media rows (each request's tap) and `text_rows`, and `fail(speech, error)` for a request
    that fails (the pipeline stops its Thinker side too). `prefix_caching`: the Talker's prompts share their
    user turns' pages through its pool's cache."""

    def __init__(
        self,
        stages: SpeechStages,
        tts: TtsEmbeds,
        text_rows: torch.Tensor,
        model_config: Qwen3OmniConfig,
        speaking: dict[str, Speech],
        fail: Callable[[Speech, str], None],
        prefix_caching: bool = False,
    ) -> None:
        self.stages, self.tts = stages, tts
        self.prefix_caching = prefix_caching
        self.text_rows = text_rows  # talker_input.text_rows: the projected row of every text token
        self.model_config, self.speaking, self.fail = model_config, speaking, fail
        self.readback = AudioReadback(deferred=stages.device.type == "cuda")

    def step(self) -> dict[str, list[np.ndarray]]:
        """Start the Talkers that can start, run one Talker step and the code predictor on what it sampled,
        then one Code2Wav step; returns the audio chunks per request that reached the host (on a GPU mostly
        those of the step before: audio_readback.py)."""
        speech: Speech | None
        starting = [s for s in self.speaking.values() if not s.talker_started and s.error is None]
        if starting:
            self.start_isolated(starting)
        self.feed_text()
        talker, streamer = self.stages.talker_stage, self.stages.streamer
        flights = talker.launch() if talker.has_unfinished() else []
        early = self.launch_frames(flights)
        frames: list[tuple[Speech, Sampled]] = []
        for row, sampled in enumerate(talker.settle(flights)):
            speech = self.speaking.get(sampled.request_id)
            if speech is None:
                continue
            if sampled.error is not None:
                self.fail(speech, f"speech failed: {sampled.error}")
            elif sampled.token == self.model_config.talker.codec_eos_token_id:
                self.end_talker(speech)
            elif early is not None and (at := early.row_of(row, speech)) is not None:
                self.accept_frames([(speech, sampled)], early.codes[at : at + 1], early.sums[at : at + 1])
            else:
                frames.append((speech, sampled))
        if frames:
            self.predict_isolated(frames)
        if early is not None or frames:
            self.feed_text()
        chunks: dict[str, list[np.ndarray]] = {}
        streaming = [s for s in self.speaking.values() if s.request_id in streamer.streams]
        made = self.guarded(streaming, streamer.step) or []
        made_for = [self.speaking.get(str(chunk.request_id)) for chunk in made]
        first = any(speech is not None and not speech.samples_out for speech in made_for)  # a first chunk
        for chunk in self.readback.exchange(made, urgent=first):
            speech = self.speaking.get(chunk.request_id)
            if speech is None:
                continue
            chunks.setdefault(chunk.request_id, []).append(chunk.samples)
            speech.first_audio = speech.first_audio or time.monotonic()
            speech.audio_done = chunk.final
            speech.samples_out += len(chunk.samples)
            self.frames_heard(speech)
        return chunks

    def frames_heard(self, speech: Speech) -> None:
        """The frames whose audio the chunks so far complete (frame k's ends at sample spf·(k + 1) − lookahead,
        `Code2Wav.num_samples`), each with the text tokens the Talker had read when it made it."""
        while (done := len(speech.spoken_frames)) < len(speech.frame_text):
            end = self.stages.code2wav.num_samples(done + 1)
            if end > speech.samples_out:
                return
            speech.spoken_frames.append(SpokenFrame(end, speech.frame_text[done]))

    def predict_isolated(self, frames: list[tuple[Speech, Sampled]]) -> None:
        """The frames in one call; if it fails, one at a time, so that only the request at fault fails (a
        frame's draws depend on its request's draw count alone, which advances only on success)."""
        if len(frames) == 1:
            self.guarded([frames[0][0]], lambda: self.predict_frames(frames))
            return
        try:
            self.predict_frames(frames)
        except Exception as exc:
            log.warning("a code-predictor batch of %d frames failed (%s); one at a time", len(frames), exc)
            for frame in frames:
                self.predict_isolated([frame])

    def guarded(self, speeches: list[Speech], work):
        """`work()`, or, if it raises, None with every request it served failed (and the others untouched)."""
        try:
            return work()
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            log.error("a speech step of %d requests failed", len(speeches), exc_info=exc)
            for speech in speeches:
                self.fail(speech, f"speech failed: {type(exc).__name__}: {exc}")
            return None

    def start_isolated(self, speeches: list[Speech]) -> None:
        """The Talkers of `speeches` started together; if that fails, one at a time, so that only the request
        at fault fails."""
        try:
            self.start_talkers(speeches)
            return
        except Exception as exc:
            if len(speeches) == 1:  # this request's hand-off failed: it fails alone
                log.error("request %s: the Talker could not start", speeches[0].request_id, exc_info=exc)
                self.fail(speeches[0], f"speech failed: {type(exc).__name__}: {exc}")
                return
            log.warning("starting %d Talkers together failed (%s); one at a time", len(speeches), exc)
        for speech in speeches:
            if not speech.talker_started and speech.error is None:
                self.start_isolated([speech])

    def start_talkers(self, speeches: list[Speech]) -> None:
        """Queue the Talker's prompt of each request whose first spoken token is known (or end a reply with
        none). The prompts are built together (`talker_prompts`), on the host but for one gather of their rows:
        a burst's first tokens start their Talkers in one pass, which waits for nothing on the device."""
        ready: list[Speech] = []
        for speech in speeches:
            if speech.spoken:
                ready.append(speech)
            elif speech.text_done:  # a one-token reply: nothing to say
                speech.talker_started = speech.talker_done = speech.audio_done = True
        if not ready:
            return
        stages, talker = self.stages, self.stages.talker_stage
        sources = [self.prompt_source(speech) for speech in ready]
        prompts = talker_prompts(stages.talker, stages.tokens, self.tts, self.text_rows, sources)
        hidden_on_host = self.media_on_host(sources) if self.prefix_caching else [None] * len(ready)
        for speech, prompt, hidden in zip(ready, prompts, hidden_on_host, strict=True):
            positions = talker_positions(prompt, self.model_config, speech.media)
            keys = None
            if hidden is not None:
                keys = talker_keys(speech.prompt_ids, stages.tokens, hidden, positions, talker.page_size)
            talker.add(
                speech.request_id, prompt.embeds, positions, speech.params.talker, speech.frame_cap, keys
            )
            speech.talker_started = True
            speech.text_read = 1  # the prompt's last row holds the first spoken token
            speech.tap = None
            stages.streamer.open(speech.request_id)

    def prompt_source(self, speech: Speech) -> PromptSource:
        """What the request's Talker prompt is built from: its Thinker prompt, the Thinker's hidden states at
        its media rows (zeros where none were kept: a reply given with the request), its first spoken token."""
        ids = torch.tensor(speech.prompt_ids)
        if speech.tap is not None:
            hidden = speech.tap.values
        else:
            media = int(torch.isin(ids, torch.tensor(self.stages.tokens.placeholders)).sum())
            width = self.model_config.thinker.text.hidden_size
            hidden = self.text_rows.new_zeros(media, width)
        return PromptSource(ids, hidden, speech.spoken[0], speech.speaker)

    def media_on_host(self, sources: list[PromptSource]) -> list[torch.Tensor]:
        """Each prompt's media hidden states on the host (the Talker's prefix keys hold their bytes), in one
        copy, and none where no prompt has media. From a GPU the copy lands in pinned memory: a pageable one
        is staged through a bounce buffer at a fraction of the bus's speed (a 30 s video's 90 MB took 65-74 ms
        of its Talker prompt's ~110 on an H100, benchmarks/RESULTS.md); the keys read the bytes at once, so
        the copy is waited for."""
        counts = [len(source.media_hidden) for source in sources]
        if not any(counts):
            width = self.model_config.thinker.text.hidden_size
            return [self.text_rows.new_empty(0, width, device="cpu") for _ in sources]
        hidden = torch.cat([source.media_hidden.to(self.text_rows.device) for source in sources])
        host = to_host(hidden)
        assert host is not None  # a tensor's copy
        if hidden.is_cuda:
            torch.cuda.current_stream(hidden.device).synchronize()
        return list(host.split(counts))

    def feed_text(self) -> None:
        """Give each Talker waiting with a finished frame its next input row, where the text row is known."""
        waiting = [s for s in self.speaking.values() if s.codec_sum is not None and s.error is None]
        ready: list[tuple[Speech, torch.Tensor | None]] = []
        token_rows: list[int] = []
        for speech in waiting:
            index = speech.rows_fed + 1  # text row k is spoken token k + 1
            spoken = speech.spoken
            if index < len(spoken):
                ready.append((speech, None))
                token_rows.append(spoken[index])
            elif speech.text_done:
                ready.append((speech, self.tts.eos if index == len(spoken) else self.tts.pad))
        if not ready:
            return
        projected: Iterator[torch.Tensor] = iter(())
        if token_rows:
            projected = iter(self.text_rows[to_device(torch.tensor(token_rows), self.stages.device)])
        for speech, text_row in ready:
            row = next(projected) if text_row is None else text_row
            assert speech.codec_sum is not None  # `waiting` holds those with a finished frame
            self.stages.talker_stage.feed(speech.request_id, speech.codec_sum + row)
            speech.codec_sum = None
            speech.rows_fed += 1
            if text_row is None:
                speech.text_read += 1

    def launch_frames(self, flights: list[InFlight]) -> EarlyFrames | None:
        """The code predictor on a Talker step's sampled ids while they are still on their way to the host, so that
        the host waits for them with both stages queued on the GPU. Every row is predicted: a row that sampled
        codec EOS gets a frame that is then dropped. Only for a step that launched whole (one flight); a failure
        here leaves the frames to `predict_isolated`, after the ids are read back."""
        flight = flights[0] if len(flights) == 1 else None
        if flight is None or flight.ids is None or flight.hidden is None:  # a failed step has neither
            return None
        speeches = [self.speaking.get(chunk.seq.request_id) for chunk in flight.ids.chunks]
        live = {row: s for row, s in enumerate(speeches) if s is not None and s.error is None}
        rows = list(live)
        if not rows:
            return None
        hidden, code0 = flight.hidden, flight.ids.sampled
        if len(rows) < len(speeches):
            index = to_device(torch.tensor(rows), code0.device)
            hidden, code0 = hidden.index_select(0, index), code0.index_select(0, index)
        try:
            codes, sums = self.run_frames(list(live.values()), hidden, code0)
        except Exception as exc:
            log.warning(
                "the code predictor on a Talker step's ids failed (%s); it runs again once they are read", exc
            )
            return None
        return EarlyFrames({row: (speech, i) for i, (row, speech) in enumerate(live.items())}, codes, sums)

    def predict_frames(self, frames: list[tuple[Speech, Sampled]]) -> None:
        """Codes 1..15 of every new frame in one batched call (a graph replay on a GPU); the frames go to
        Code2Wav."""
        code0 = to_device(torch.tensor([s.token for _, s in frames]), self.stages.device)
        hidden = torch.stack(cast("list[torch.Tensor]", [s.hidden for _, s in frames]))  # sampled: not failed
        self.accept_frames(frames, *self.run_frames([speech for speech, _ in frames], hidden, code0))

    def run_frames(
        self, speeches: list[Speech], hidden: torch.Tensor, code0: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frames `[B, G]` (code 0 first) and codec embedding sums `[B, H]` of B speaking requests from the
        Talker's hidden states `[B, H]` and code-0 ids `[B]` (device tensors), each request's draws where they
        stand. Copies of the graph's outputs, which its next replay overwrites."""
        count = len(speeches)
        residual, sums = self.stages.frame_graphs.run(
            hidden,
            code0,
            greedy=[s.params.talker.greedy for s in speeches],
            temperature=[PREDICTOR_TEMPERATURE] * count,
            top_p=[PREDICTOR_TOP_P] * count,
            seeds=[s.predictor_seed for s in speeches],
            draws=[s.predictor_draws for s in speeches],
        )
        return torch.cat((code0[:, None], residual), dim=1), sums.clone()

    def accept_frames(
        self, frames: list[tuple[Speech, Sampled]], frame_codes: torch.Tensor, sums: torch.Tensor
    ) -> None:
        """Each request's new frame to its codes and Code2Wav; its draws advance. A request waiting for its text
        row keeps the frame's sum (`feed_text`)."""
        for (speech, sampled), codes, codec_sum in zip(frames, frame_codes, sums):
            speech.predictor_draws += self.model_config.talker.num_code_groups - 1
            # on the device: read back once, when the request ends (no sync per step)
            speech.codes.append(codes)
            speech.frame_text.append(speech.text_read)
            self.stages.streamer.feed(speech.request_id, codes[:, None])
            if sampled.finished:
                self.end_talker(speech)
            else:
                speech.codec_sum = codec_sum

    def end_talker(self, speech: Speech) -> None:
        speech.talker_done = True
        speech.codec_sum = None
        self.stages.streamer.finish(speech.request_id)
