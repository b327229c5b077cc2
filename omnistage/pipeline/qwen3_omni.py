"""Qwen3-Omni's stages wired together: the encoders and Thinker (an LLMEngine), then, for a request that
speaks, the Talker (an EmbeddingStage), the code predictor and streaming Code2Wav. The one facade the server
and the offline `LLM` talk to: requests in, `RequestOutput`s out, text and audio side by side.

The hand-off streams, by the rules of `models/qwen3_omni/talker_input.py` (equal to transformers' offline
`generate(return_audio=True)`):
- the Thinker keeps the hidden states after `accept_hidden_layer` layers at its prompt's media rows;
- the Thinker's last token is never spoken, and the Thinker knows a token is its last when it yields it (it
  finishes there): every token it yields unfinished is spoken. The Talker's prompt is built as soon as the
  first one is known, with the Thinker's first token;
- the Talker's decode step k reads text row k (spoken token k + 1, then tts_eos once, then tts_pad) and waits
  until the Thinker has yielded that token (or ended);
- every code 0 the Talker samples but codec EOS becomes a frame through the code predictor, whose 16-embedding
  sum plus the next text row is the Talker's next input; frames stream into Code2Wav, and its chunks go out
  with the request's outputs. A request finishes when its text and its audio have.
"""

from __future__ import annotations

import json
import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from omnistage.config import STAGES, EngineConfig, validate_topology
from omnistage.engine.attention import backend_for
from omnistage.engine.capture_plan import (
    NO_OTHER_STAGES,
    Gauge,
    MemoryPlan,
    plan_device,
)
from omnistage.engine.embedding_stage import Sampled
from omnistage.engine.encoder_engine import EncoderEngine
from omnistage.engine.llm_engine import LLMEngine, NewRequest, StageModels, resolve_device, resolve_dtype
from omnistage.engine.model_runner import HiddenTap
from omnistage.engine.sampling import SamplingParams, SpeechParams
from omnistage.engine.stage_plan import read_device
from omnistage.errors import InvalidRequest
from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.talker_input import (
    TtsEmbeds,
    talker_positions,
    talker_prompt,
    tts_embeds,
    user_turn_mask,
)
from omnistage.models.qwen3_omni.thinker import load_thinker
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.side_stream import SideStream
from omnistage.pipeline.speech_stages import PREDICTOR_TEMPERATURE, PREDICTOR_TOP_P, SpeechStages

log = logging.getLogger(__name__)

ASSISTANT_ROWS = 9  # the Talker prompt's rows after the user turns (talker_input.talker_prompt)
# The audio cap when a request sets none: 2 s, plus 8 frames (0.64 s) per spoken token, about twice a
# speaker's pace, and never past transformers' own talker limit of 4096 frames (327.7 s).
CAP_BASE_FRAMES, CAP_FRAMES_PER_TOKEN, MAX_AUDIO_FRAMES = 25, 8, 4096


def default_frame_cap(text_tokens: int) -> int:
    return min(MAX_AUDIO_FRAMES, CAP_BASE_FRAMES + CAP_FRAMES_PER_TOKEN * text_tokens)


@dataclass(frozen=True)
class TtsPrompt:
    """A text-to-speech request: the prompt the Talker is conditioned on, and the reply it speaks."""

    prompt: str
    token_ids: list[int]
    reply_token_ids: list[int]


def load_thinker_stage(
    config: EngineConfig, path: Path, cfg: Qwen3OmniConfig, device: torch.device, dtype: torch.dtype
) -> StageModels:
    """The Thinker's decoder, its processor and the audio and vision encoders, for an LLMEngine."""
    started = time.perf_counter()
    model = load_thinker(path, dtype, device, backend_for(device), config.load_format, seed=config.seed)
    encoders = EncoderEngine.qwen3_omni(path, cfg.thinker, dtype, device, config.load_format, config.seed)
    processor = Processor(path)
    return StageModels(
        model=model,
        text=cfg.thinker.text,
        processor=processor,
        encoders=encoders,
        eos_token_ids=eos_token_ids(path, processor),
        model_path=path,
        load_seconds=time.perf_counter() - started,
    )


def eos_token_ids(checkpoint_dir: Path, processor: Processor) -> list[int]:
    """The checkpoint's generation end tokens, else `<|im_end|>`."""
    path = checkpoint_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return [processor.tokenizer.token_to_id("<|im_end|>")]


def tts_prompt(processor: Processor, text: str, max_model_len: int) -> TtsPrompt:
    """The prompt and reply of speaking `text` exactly: the text as the user's turn, and as the reply."""
    prompt, token_ids = processor.encode_chat([{"role": "user", "content": text}], True, max_model_len)
    return TtsPrompt(prompt, token_ids, processor.encode(text, max_model_len))


@dataclass
class _Speech:
    """One speaking request's progress across the stages."""

    request_id: str
    params: SpeechParams
    speaker: int
    prompt_ids: list[int]
    grids: list[tuple[int, int, int]]
    audio_tokens: list[int]
    frame_cap: int
    tap: HiddenTap | None
    text: RequestOutput  # the latest text-side output (the Thinker's, or the given reply's)
    generated: list[int] = field(default_factory=list)  # the Thinker's tokens so far
    text_done: bool = False
    talker_started: bool = False
    predictor_seed: int = (
        0  # the code predictor's draws: a function of (seed, draw number), see static_sampling
    )
    predictor_draws: int = 0
    rows_fed: int = 0  # the Talker's decode rows given so far = text rows consumed
    codec_sum: torch.Tensor | None = None  # the last frame's embedding sum, waiting for its text row
    codes: list[torch.Tensor] = field(default_factory=list)  # one [num_code_groups] row per frame
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


class Qwen3OmniPipeline:
    def __init__(self, config: EngineConfig) -> None:
        from omnistage.models.qwen3_omni.tiny import default_checkpoint

        self.config = config
        path = Path(config.model) if config.model else default_checkpoint()
        self.model_config = cfg = Qwen3OmniConfig.from_dir(path)
        self.speaks = config.speech and cfg.enable_audio_output
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        validate_topology(config, gpus, stages=STAGES if self.speaks else STAGES[:2])
        device = resolve_device(config.stage("thinker").device)
        dtype = resolve_dtype(config.dtype, device)
        self.speech_plan: MemoryPlan | None = None  # the speech device's own plan (two-GPU topology)
        text = cfg.thinker.text
        thinker_len = min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        memory = NO_OTHER_STAGES
        # the two-GPU topology: the speech stages on a device of their own (hand-offs cross with .to)
        self.speech_device = resolve_device(config.stage("talker").device)
        shared = self.speech_device == device
        self.speech_stages: SpeechStages | None = None
        if self.speaks:
            # loaded and measured before the Thinker plans its memory: a shared device has one plan for all.
            # The longest Talker sequence: the user turns of the longest prompt, its assistant rows, the audio cap
            self.speech_stages = SpeechStages(
                config, path, cfg, dtype, thinker_len + ASSISTANT_ROWS + MAX_AUDIO_FRAMES
            )
            if self.speech_device.type == "cuda":
                with self.speech_stages.on_device():
                    memory = self.speech_stages.memory(shared)
        self.thinker = LLMEngine(
            config,
            load_thinker_stage(config, path, cfg, device, dtype),
            device,
            dtype,
            memory if shared else NO_OTHER_STAGES,
        )
        if self.speech_stages is not None and memory is not NO_OTHER_STAGES:
            with self.speech_stages.on_device():
                plan = self.thinker.plan
                if not shared:
                    device_memory = read_device(self.speech_device, config.gpu_memory_limit_gib)
                    plan = self.speech_plan = plan_device(device_memory, [memory])
                    log.info("%s", plan.table())
                self.speech_stages.allocate(plan, self.thinker.graph_pool if shared else None)
        self.processor, self.tokenizer = self.thinker.processor, self.thinker.tokenizer
        self.model_path, self.max_model_len = self.thinker.model_path, self.thinker.max_model_len
        self.device, self.dtype = device, dtype
        self._speaking: dict[str, _Speech] = {}
        # on a GPU the Thinker runs on a stream of its own; its steps run beside the speech stages' (`step`)
        self._thinker_side = SideStream(device, "thinker") if self.speaks and device.type == "cuda" else None
        self.overlap = config.overlap_stages
        self._deferred_aborts: list[str] | None = None  # while a Thinker step runs beside: aborts wait for it
        if self.speaks:
            with torch.inference_mode():
                self.tts: TtsEmbeds = tts_embeds(
                    self.speech_stages.talker, self._embedding, self.speech_stages.tokens
                )

    @property
    def _embedding(self) -> torch.nn.Embedding:
        return self.thinker.model.model.embed_tokens

    @property
    def voices(self) -> tuple[str, ...]:
        """The released speakers' names (lower case); empty when this pipeline cannot speak."""
        return tuple(sorted(self.speech_stages.tokens.speakers)) if self.speaks else ()

    def plan_gauges(self) -> list[Gauge]:
        """Every device's memory plan as gauge samples (none on a CPU), for `/metrics`."""
        plans = [plan for plan in (self.thinker.plan, self.speech_plan) if plan is not None]
        return [gauge for plan in plans for gauge in plan.gauges()]

    def memory_summary(self) -> str:
        summary = self.thinker.memory_summary()
        if self.speech_stages is None:
            return f"{summary}; speech off"
        return f"{summary}; {self.speech_stages.summary()}"

    # -- requests -----------------------------------------------------------------------------------

    def tts_prompt(self, text: str) -> TtsPrompt:
        return tts_prompt(self.processor, text, self.max_model_len)

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, speech: SpeechParams | None = None
    ) -> int:
        """Check a request against every stage it needs; return the Thinker's effective max_tokens."""
        if speech is None:
            return self.thinker.validate(prompt_token_ids, params)
        if not self.speaks:
            raise InvalidRequest(
                "this server does not speak: the checkpoint has no talker, or speech is off in its config"
            )
        try:
            self.speech_stages.tokens.speaker_id(speech.voice)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if speech.reply_token_ids is None:
            max_tokens = self.thinker.validate(prompt_token_ids, params)
            text_tokens = max_tokens
        else:
            if not speech.reply_token_ids:
                raise InvalidRequest("there is no text to speak")
            max_tokens = self.thinker.validate(prompt_token_ids, SamplingParams(max_tokens=1))
            text_tokens = len(speech.reply_token_ids)
        ids = torch.tensor(prompt_token_ids)
        tokens = self.speech_stages.tokens
        if len(ids) < 3 or ids[-3:].tolist() != [tokens.im_start, tokens.assistant, ids[-1].item()]:
            raise InvalidRequest(
                "a spoken reply needs a chat prompt that ends by opening the assistant's turn"
            )
        talker_prompt_len = int(user_turn_mask(ids, tokens).sum()) + ASSISTANT_ROWS
        self.speech_stages.talker_stage.pool.check_admissible(
            talker_prompt_len + self._frame_cap(speech, text_tokens)
        )
        return max_tokens

    def _frame_cap(self, speech: SpeechParams, text_tokens: int) -> int:
        return speech.talker.max_tokens or default_frame_cap(text_tokens)

    def add_requests(self, requests: list[NewRequest]) -> list[Exception | None]:
        """Admit several requests (their media encoded together); per request, None or what kept it out."""
        errors: list[Exception | None] = [None] * len(requests)
        thinker_requests, indices = [], []
        for i, r in enumerate(requests):
            if r.speech is None:
                thinker_requests.append(r)
                indices.append(i)
                continue
            try:
                max_tokens = self.validate(r.prompt_token_ids, r.params, r.speech)
            except Exception as exc:
                errors[i] = exc
                continue
            speech = self._new_speech(r, max_tokens)
            if r.speech.reply_token_ids is None:
                thinker_requests.append(replace(r, tap=speech.tap))
                indices.append(i)
            self._speaking[r.request_id] = speech
        for i, error in zip(indices, self.thinker.add_requests(thinker_requests)):
            if error is not None:
                errors[i] = error
                self._speaking.pop(requests[i].request_id, None)
        return errors

    def _new_speech(self, r: NewRequest, max_tokens: int) -> _Speech:
        mm = r.mm
        grids = (
            [] if mm is None or mm.image_grid_thw is None else [tuple(g) for g in mm.image_grid_thw.tolist()]
        )
        ids = torch.tensor(r.prompt_token_ids)
        media_rows = torch.isin(ids, torch.tensor(self.speech_stages.tokens.placeholders)).nonzero()[:, 0]
        tap = None
        if len(media_rows) and r.speech.reply_token_ids is None:
            width = self.model_config.thinker.text.hidden_size
            tap = HiddenTap(
                self.model_config.talker.accept_hidden_layer,
                media_rows.to(self.device),
                torch.zeros(len(media_rows), width, dtype=self.dtype, device=self.device),
            )
        reply = r.speech.reply_token_ids
        text = RequestOutput(
            r.request_id,
            r.prompt,
            r.prompt_token_ids,
            [CompletionOutput(0, "", [])],
            metrics={"arrival": time.monotonic()},
        )
        speech = _Speech(
            request_id=r.request_id,
            params=r.speech,
            speaker=self.speech_stages.tokens.speaker_id(r.speech.voice),
            prompt_ids=list(r.prompt_token_ids),
            grids=grids,
            audio_tokens=[] if mm is None else list(mm.num_audio_tokens),
            frame_cap=self._frame_cap(r.speech, len(reply) if reply is not None else max_tokens),
            tap=tap,
            text=text,
            # an unseeded request's draws still differ from every other's
            predictor_seed=seed if (seed := r.speech.talker.seed) is not None else random.getrandbits(63),
        )
        if reply is not None:  # the reply is given: it is all known, and its end is the unspoken last token
            speech.generated = [*reply, self.model_config.im_end_token_id]
            speech.text_done = True
            completion = CompletionOutput(
                0,
                self.processor.decode(reply),
                list(reply),
                finish_reason="stop",
                delta_text="",
                delta_token_ids=[],
            )
            speech.text = replace(text, outputs=[completion], finished=True)
        return speech

    def abort(self, request_id: str) -> RequestOutput | None:
        speech = self._speaking.pop(request_id, None)
        if speech is not None and self.speaks:
            self.speech_stages.talker_stage.abort(request_id)
            self.speech_stages.streamer.cancel(request_id)
        out = self.thinker.abort(request_id)
        if out is None and speech is not None:
            completion = replace(
                speech.text.outputs[0], finish_reason="abort", delta_text="", delta_token_ids=[]
            )
            out = replace(speech.text, outputs=[completion], finished=True)
        return out

    def has_unfinished(self) -> bool:
        return self.thinker.has_unfinished() or bool(self._speaking)

    @property
    def num_waiting(self) -> int:
        return self.thinker.num_waiting

    def stats(self) -> dict[str, int]:
        stats = self.thinker.stats()
        if self.speaks:
            pool = self.speech_stages.talker_stage.pool
            stats |= {
                "talker_kv_pages_total": pool.num_pages,
                "talker_kv_pages_free": pool.num_free,
                "num_speaking": len(self._speaking),
            }
        return stats

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """A Thinker step, then a speaking step on the text known so far. On a GPU, once every speaking request's
        Talker runs, the two run at once (`side_stream.py`), the Talker reading the text of the steps before:
        it is a step behind the Thinker anyway (row k is token k + 1). Before that, the Thinker's step comes
        first, so that a new request's Talker starts on its first token in the same step."""
        outputs: list[RequestOutput] = []
        touched: dict[str, _Speech] = {}
        beside = None
        if self.thinker.has_unfinished():
            if self._beside():
                self._deferred_aborts = []
                beside = self._thinker_side.submit(self.thinker.step)
            else:
                self._on_thinker(self._thinker_step(), outputs, touched)
        try:
            chunks = self._speak() if self._speaking else {}
        finally:  # the Thinker's step ends before anything else touches it, also when the speaking step raised
            thinker_outputs = self._join(beside) if beside is not None else []
        self._on_thinker(thinker_outputs, outputs, touched)
        for request_id, speech in self._speaking.items():
            if request_id in chunks or speech.finished:
                touched[request_id] = speech
        for request_id, speech in touched.items():
            outputs.append(self._output(speech, chunks.get(request_id, [])))
            if speech.finished:
                self._speaking.pop(request_id, None)
        return outputs

    def _join(self, beside: Future[list[RequestOutput]]) -> list[RequestOutput]:
        """The Thinker's step beside, then the aborts that waited for it (also when it raised)."""
        try:
            return self._thinker_side.join(beside)
        finally:
            aborts, self._deferred_aborts = self._deferred_aborts, None
            for request_id in aborts:
                self.thinker.abort(request_id)

    def _beside(self) -> bool:
        """Whether this step's Thinker step runs beside the speaking step: every Talker has started, and the
        Thinker's step replays a decode graph, which allocates little on the side stream (side_stream.py).
        Its eager steps (prefills) also call the layers torch.compile wraps, as the Talker's eager steps do:
        dynamo's caches of one code object are not entered from two threads."""
        return (
            self._thinker_side is not None
            and self.overlap
            and bool(self._speaking)
            and all(s.talker_started or s.error is not None for s in self._speaking.values())
            and self.thinker.replays_next_step()
        )

    def _thinker_step(self) -> list[RequestOutput]:
        outputs = self.thinker.step()
        if self._thinker_side is not None:  # a Thinker step beside starts after this one's KV writes
            self._thinker_side.mark()
        return outputs

    def _on_thinker(
        self, thinker_outputs: list[RequestOutput], outputs: list[RequestOutput], touched: dict[str, _Speech]
    ) -> None:
        """A Thinker step's outputs: text-only ones go out as they are; a speaking request's update its text."""
        for out in thinker_outputs:
            speech = self._speaking.get(out.request_id)
            if speech is None:
                outputs.append(out)
                continue
            if speech.error is None:  # one failed meanwhile, in the speaking step beside, keeps its error
                self._on_text(speech, out)
            touched[out.request_id] = speech

    def _on_text(self, speech: _Speech, out: RequestOutput) -> None:
        completion = out.outputs[0]
        speech.text = out
        speech.generated = completion.token_ids
        if not out.finished:
            return
        speech.text_done = True
        if completion.finish_reason in ("error", "abort"):
            self._fail(speech, out.error or f"the reply's text ended with {completion.finish_reason}")
            return
        if speech.params.talker.max_tokens is None:  # the cap follows the text, now that its length is known
            speech.frame_cap = min(speech.frame_cap, default_frame_cap(max(0, len(speech.generated) - 1)))
            if (
                speech.talker_started
                and not speech.talker_done
                and self.speech_stages.talker_stage.cap(speech.request_id, speech.frame_cap)
            ):
                self._end_talker(speech)

    def _fail(self, speech: _Speech, error: str) -> None:
        speech.error = error
        if self._deferred_aborts is not None:  # the Thinker is mid-step on its thread
            self._deferred_aborts.append(speech.request_id)
        else:
            self.thinker.abort(speech.request_id)
        self.speech_stages.talker_stage.abort(speech.request_id)
        self.speech_stages.streamer.cancel(speech.request_id)

    def _speak(self) -> dict[str, list[np.ndarray]]:
        with torch.inference_mode(), self.speech_stages.on_device():
            return self._speak_here()

    def _speak_here(self) -> dict[str, list[np.ndarray]]:
        """Start the Talkers that can start, run one Talker step and the code predictor on what it sampled,
        then one Code2Wav step; returns the audio chunks per request."""
        for speech in list(self._speaking.values()):
            if not speech.talker_started and speech.error is None:
                try:
                    self._start_talker(speech)
                except Exception as exc:  # this request's hand-off failed: it fails alone
                    log.error("request %s: the Talker could not start", speech.request_id, exc_info=exc)
                    self._fail(speech, f"speech failed: {type(exc).__name__}: {exc}")
        self._feed_text()
        talker, streamer = self.speech_stages.talker_stage, self.speech_stages.streamer
        frames: list[tuple[_Speech, Sampled]] = []
        for sampled in talker.step() if talker.has_unfinished() else []:
            speech = self._speaking.get(sampled.request_id)
            if speech is None:
                continue
            if sampled.error is not None:
                self._fail(speech, f"speech failed: {sampled.error}")
            elif sampled.token == self.model_config.talker.codec_eos_token_id:
                self._end_talker(speech)
            else:
                frames.append((speech, sampled))
        if frames:
            self._predict_isolated(frames)
            self._feed_text()
        chunks: dict[str, list[np.ndarray]] = {}
        streaming = [s for s in self._speaking.values() if s.request_id in streamer.streams]
        for chunk in self._guarded(streaming, streamer.step) or []:
            speech = self._speaking.get(chunk.request_id)
            if speech is None:
                continue
            chunks.setdefault(chunk.request_id, []).append(chunk.samples.float().cpu().numpy())
            speech.first_audio = speech.first_audio or time.monotonic()
            speech.audio_done = chunk.final
        return chunks

    def _predict_isolated(self, frames: list[tuple[_Speech, Sampled]]) -> None:
        """The frames in one call; if it fails, one at a time, so that only the request at fault fails (a
        frame's draws depend on its request's draw count alone, which advances only on success)."""
        if len(frames) == 1:
            self._guarded([frames[0][0]], lambda: self._predict_frames(frames))
            return
        try:
            self._predict_frames(frames)
        except Exception as exc:
            log.warning("a code-predictor batch of %d frames failed (%s); one at a time", len(frames), exc)
            for frame in frames:
                self._predict_isolated([frame])

    def _guarded(self, speeches: list[_Speech], work):
        """`work()`, or, if it raises, None with every request it served failed (and the others untouched)."""
        try:
            return work()
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            log.error("a speech step of %d requests failed", len(speeches), exc_info=exc)
            for speech in speeches:
                self._fail(speech, f"speech failed: {type(exc).__name__}: {exc}")
            return None

    def _start_talker(self, speech: _Speech) -> None:
        """Queue the Talker's prompt once the first spoken token is known (or end a reply with none)."""
        spoken = speech.spoken
        if not spoken:
            if speech.text_done:  # a one-token reply: nothing to say
                speech.talker_started = speech.talker_done = speech.audio_done = True
            return
        ids = torch.tensor(speech.prompt_ids, device=self.device)
        embeds = self._embedding(ids)
        accept = embeds.new_zeros(embeds.shape)
        if speech.tap is not None:
            accept[speech.tap.rows] = speech.tap.values
        first = self._embedding(torch.tensor(spoken[0], device=self.device))
        to, stages = self.speech_device, self.speech_stages
        prompt = talker_prompt(
            stages.talker, stages.tokens, self.tts, ids.to(to), embeds.to(to), accept.to(to), first.to(to),
            speech.speaker,
        )  # fmt: skip
        positions = talker_positions(prompt, self.model_config, speech.grids, speech.audio_tokens)
        stages.talker_stage.add(
            speech.request_id, prompt.embeds, positions, speech.params.talker, speech.frame_cap
        )
        speech.talker_started = True
        speech.tap = None
        stages.streamer.open(speech.request_id)

    def _feed_text(self) -> None:
        """Give each Talker waiting with a finished frame its next input row, where the text row is known."""
        waiting = [s for s in self._speaking.values() if s.codec_sum is not None and s.error is None]
        ready, token_rows = [], []
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
        projected = iter(())
        if token_rows:
            projected = iter(
                self.speech_stages.talker.text_projection(
                    self._embedding(to_device(torch.tensor(token_rows), self.device)).to(self.speech_device)
                )
            )
        for speech, text_row in ready:
            row = next(projected) if text_row is None else text_row
            self.speech_stages.talker_stage.feed(speech.request_id, speech.codec_sum + row)
            speech.codec_sum = None
            speech.rows_fed += 1

    def _predict_frames(self, frames: list[tuple[_Speech, Sampled]]) -> None:
        """Codes 1..15 of every new frame in one batched call (a graph replay on a GPU); the frames go to
        Code2Wav."""
        code0 = to_device(torch.tensor([s.token for _, s in frames]), self.speech_device)
        hidden = torch.stack([s.hidden for _, s in frames])
        speeches = [speech for speech, _ in frames]
        count = len(frames)
        residual, sums = self.speech_stages.frame_graphs.run(
            hidden,
            code0,
            greedy=[s.params.talker.greedy for s in speeches],
            temperature=[PREDICTOR_TEMPERATURE] * count,
            top_p=[PREDICTOR_TOP_P] * count,
            seeds=[s.predictor_seed for s in speeches],
            draws=[s.predictor_draws for s in speeches],
        )
        # the graph's outputs are overwritten by its next replay; a request waiting for its text row keeps its sum
        sums = sums.clone()
        for speech in speeches:
            speech.predictor_draws += self.model_config.talker.num_code_groups - 1
        frame_codes = torch.cat((code0[:, None], residual), dim=1)
        for (speech, sampled), codes, codec_sum in zip(frames, frame_codes, sums):
            # on the device: read back once, when the request ends (no sync per step)
            speech.codes.append(codes)
            self.speech_stages.streamer.feed(speech.request_id, codes[:, None])
            if sampled.finished:
                self._end_talker(speech)
            else:
                speech.codec_sum = codec_sum

    def _end_talker(self, speech: _Speech) -> None:
        speech.talker_done = True
        speech.codec_sum = None
        self.speech_stages.streamer.finish(speech.request_id)

    def _output(self, speech: _Speech, chunks: list[np.ndarray]) -> RequestOutput:
        text = speech.text
        finished = speech.finished
        completion = text.outputs[0]
        if speech.error is not None:
            completion = replace(completion, finish_reason="error")
        elif not finished:
            completion = replace(completion, finish_reason=None)
        out = replace(
            text,
            outputs=[completion],
            finished=finished,
            error=speech.error,
            audio_delta=np.concatenate(chunks) if chunks else None,
            num_audio_frames=len(speech.codes),
        )
        speech.text = replace(text, outputs=[replace(text.outputs[0], delta_text="", delta_token_ids=[])])
        speech.audio += chunks
        if speech.first_audio:
            out.metrics = {**out.metrics, "first_audio": speech.first_audio}
        if finished:
            out.audio = np.concatenate(speech.audio) if speech.audio else np.zeros(0, dtype=np.float32)
            out.audio_codes = torch.stack(speech.codes).tolist() if speech.codes else []
        return out
