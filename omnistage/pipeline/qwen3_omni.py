"""Qwen3-Omni's stages wired together: the encoders and Thinker (a TextStage), then, for a request that
speaks, the Talker, the code predictor and streaming Code2Wav (`speech_stages.py`), the text and frames handed
across them step by step (`handoff.py`). The one facade the server and the offline `LLM` talk to: requests in,
`RequestOutput`s out, text and audio side by side."""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from omnistage.config import STAGES, EngineConfig
from omnistage.engine.attention import backend_for
from omnistage.engine.devices import resolve_device, resolve_dtype
from omnistage.engine.memory.gauges import Gauge, plan_gauges
from omnistage.engine.memory.plan import MemoryPlan
from omnistage.engine.stages.text import NewRequest, StageModels, TextStage
from omnistage.engine.stages.token_runner import HiddenTap
from omnistage.errors import CheckpointError, InvalidRequest, RequestTooLarge
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.talker_input import text_rows, tts_embeds, user_turn_mask
from omnistage.models.qwen3_omni.thinker import load_thinker
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.base import Frontend, TtsPrompt
from omnistage.pipeline.handoff import Handoff, Speech
from omnistage.pipeline.planning import plan_devices
from omnistage.pipeline.qwen3_omni_encoders import load_encoders
from omnistage.pipeline.side_stream import SideStream
from omnistage.pipeline.speech_stages import SpeechStages
from omnistage.pipeline.topology import validate_topology
from omnistage.request import (
    MAX_AUDIO_FRAMES,
    GenerationRequest,
    SamplingParams,
    SpeechParams,
    ValidRequest,
)

log = logging.getLogger(__name__)

ASSISTANT_ROWS = 9  # the Talker prompt's rows after the user turns (talker_input.talker_prompt)
# The audio cap when a request sets none: 2 s, plus 8 frames (0.64 s) per spoken token, about twice a
# speaker's pace, never past MAX_AUDIO_FRAMES.
CAP_BASE_FRAMES, CAP_FRAMES_PER_TOKEN = 25, 8


def default_frame_cap(text_tokens: int) -> int:
    return min(MAX_AUDIO_FRAMES, CAP_BASE_FRAMES + CAP_FRAMES_PER_TOKEN * text_tokens)


def max_speaking(config: EngineConfig, device: torch.device) -> int:
    """The most speaking requests in flight: the config's, else as many as one speaking step serves at about
    the cost of one. On a GPU that is the Talker's batch, its graphs' largest: a bound of Code2Wav's 16 streams
    per call held the H200 at ~100 audio s/s from c=16 on and queued c=64's first packets for 2.5 s
    (benchmarks/RESULTS.md, "Under load"). Eagerly a step's cost grows with its rows: there it is also no more
    than a Code2Wav call's streams, so that the first speeches finish first and a chat keeps its pace."""
    if config.max_num_speaking is not None:
        return config.max_num_speaking
    talker = config.stage("talker").max_batch
    if device.type == "cuda" and not config.stage("talker").enforce_eager:
        return talker
    return min(talker, config.stage("code2wav").max_streams)


def _about(exc: InvalidRequest, field: str) -> InvalidRequest:
    """`exc`, marked with the part of a speaking request it is about (`max_frames`, `text`: the reply's length,
    `voice`), which the server spells as the route's field (server/errors.py)."""
    exc.field = field
    return exc


@dataclass(frozen=True)
class _Waiting:
    """A speaking request validated and waiting for its turn (`max_speaking`)."""

    valid: ValidRequest
    arrival: float


def load_thinker_stage(
    config: EngineConfig,
    path: Path,
    cfg: Qwen3OmniConfig,
    processor: Processor,
    device: torch.device,
    dtype: torch.dtype,
) -> StageModels:
    """The Thinker's decoder and the audio and vision encoders, with `processor`, for a TextStage."""
    started = time.perf_counter()
    options = LoadOptions(dtype, device, config.load_format, config.seed)
    model = load_thinker(path, options, backend_for(device))
    encoders = load_encoders(path, cfg.thinker, options)
    return StageModels(
        model=model,
        text=cfg.thinker.text,
        processor=processor,
        encoders=encoders,
        eos_token_ids=eos_token_ids(path, processor.tokenizer),
        model_path=path,
        load_seconds=time.perf_counter() - started,
    )


def eos_token_ids(checkpoint_dir: Path, tokenizer: Tokenizer) -> list[int]:
    """The checkpoint's generation end tokens, else `<|im_end|>`."""
    path = checkpoint_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end is None:
        raise CheckpointError(
            f"{checkpoint_dir}: no generation_config.json eos_token_id, nor <|im_end|> to end on"
        )
    return [im_end]


def tts_prompt(processor: Processor, text: str, max_model_len: int) -> TtsPrompt:
    """The prompt and reply of speaking `text` exactly: the text as the user's turn, and as the reply."""
    prompt, token_ids = processor.encode_chat([{"role": "user", "content": text}], True, max_model_len)
    return TtsPrompt(prompt, token_ids, processor.encode(text, max_model_len))


def omni_frontend(
    processor: Processor,
    model_path: Path,
    max_model_len: int,
    voices: tuple[str, ...] = (),
    plan_gauges: tuple[Gauge, ...] = (),
) -> Frontend:
    """A Qwen3-Omni pipeline's Frontend: a text is spoken as the user's turn and as the reply (`tts_prompt`)."""
    speak = partial(tts_prompt, processor, max_model_len=max_model_len)
    return Frontend(model_path, max_model_len, processor, speak, voices, plan_gauges)


class Qwen3OmniPipeline:
    """Qwen3-Omni's stages behind the Pipeline interface (base.py)."""

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
        text = cfg.thinker.text
        thinker_len = min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        # the two-GPU topology: the speech stages on a device of their own (hand-offs cross with .to)
        self.speech_device = resolve_device(config.stage("talker").device)
        shared = self.speech_device == device
        self.speech_stages: SpeechStages | None = None
        if self.speaks:
            # the longest Talker sequence: the user turns of the longest prompt, its assistant rows, the audio cap
            self.speech_stages = SpeechStages(
                config, path, cfg, dtype, thinker_len + ASSISTANT_ROWS + MAX_AUDIO_FRAMES, shared
            )
        processor = Processor(path)
        thinker_stage = load_thinker_stage(config, path, cfg, processor, device, dtype)
        if self.speech_stages is not None:
            # the Talker reads these hidden states of a spoken reply's media rows (`_new_speech`)
            thinker_stage = replace(thinker_stage, tap_layer=cfg.talker.accept_hidden_layer)
            # before the devices are read for their plans: the table is the speech stages' resident memory
            with torch.inference_mode(), self.speech_stages.on_device():
                embedding = thinker_stage.model.model.embed_tokens
                tts = tts_embeds(self.speech_stages.talker, embedding, self.speech_stages.tokens)
                table = text_rows(self.speech_stages.talker, embedding)
        self.thinker = TextStage(config, thinker_stage, device, dtype)
        self.plans = self._plan(shared)
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.model_path, self.max_model_len = self.thinker.model_path, self.thinker.max_model_len
        self.device, self.dtype = device, dtype
        self._speaking: dict[str, Speech] = {}
        # speaking requests beyond max_speaking wait here, in arrival order; text requests never do
        self.max_speaking = max_speaking(config, self.speech_device)
        self._waiting: deque[_Waiting] = deque()
        self._refused: list[RequestOutput] = []  # waiting requests the Thinker refused when their turn came
        # on a GPU the Thinker has a stream of its own, for its steps beside the speech stages' (`step`) when
        # overlap_stages is on (speech_profile.py times both ways)
        self._thinker_side = SideStream(device, "thinker") if self.speaks and device.type == "cuda" else None
        self.overlap = config.overlap_stages
        if self.overlap and self._thinker_side is not None:
            self.thinker.decode_ahead = False  # its steps beside are overlapped already, on a thread
            log.warning(
                "overlap_stages: the Thinker's steps run beside the speech stages'; on an H200 with driver "
                "580.159.04 a process so run stalled for minutes (README, 'Speech out')"
            )
        self._deferred_aborts: list[str] | None = None  # while a Thinker step runs beside: aborts wait for it
        if self.speech_stages is not None:
            self.handoff = Handoff(
                self.speech_stages, tts, self._embedding, table, device, cfg, self._speaking, self._fail
            )
        gauges = tuple(gauge for plan in self.plans.values() for gauge in plan_gauges(plan))
        self.frontend = omni_frontend(
            self.processor, self.model_path, self.max_model_len, self.voices, gauges
        )

    @property
    def _embedding(self) -> torch.nn.Embedding:
        return self.thinker.model.model.embed_tokens

    @property
    def voices(self) -> tuple[str, ...]:
        """The released speakers' names (lower case); empty when this pipeline cannot speak."""
        return tuple(sorted(self.speech_stages.tokens.speakers)) if self.speech_stages is not None else ()

    def _plan(self, shared: bool) -> dict[torch.device, MemoryPlan]:
        """Each GPU's plan, for every stage on it at once, and each stage's grant taken: the Thinker's first,
        whose main-stream graph pool the speech stages join on a device they share with it."""
        needs = [(self.thinker.device, self.thinker.memory())] if self.thinker.device.type == "cuda" else []
        speech = self.speech_stages
        if speech is not None and speech.device.type == "cuda":
            with speech.on_device():
                needs.append((speech.device, speech.memory()))
        plans = plan_devices(needs, self.config.gpu_memory_limit_gib)
        if self.thinker.device in plans:
            self.thinker.allocate(plans[self.thinker.device])
        if speech is not None and speech.device in plans:
            with speech.on_device():
                speech.allocate(plans[speech.device], self.thinker.graph_pool if shared else None)
        return plans

    def memory_summary(self) -> str:
        summary = self.thinker.memory_summary()
        if self.speech_stages is None:
            return f"{summary}; speech off"
        return f"{summary}; {self.speech_stages.summary()}"

    # -- requests -----------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> ValidRequest:
        """Check a request against every stage it needs, once: what admits it trusts the ValidRequest."""
        prompt_token_ids, params, speech = request.prompt_token_ids, request.params, request.speech
        if speech is None:
            return ValidRequest(request, self.thinker.validate(prompt_token_ids, params))
        if self.speech_stages is None:
            raise InvalidRequest(
                "this server does not speak: the checkpoint has no talker, or speech is off in its config"
            )
        try:
            self.speech_stages.tokens.speaker_id(speech.voice)
        except ValueError as exc:
            raise _about(InvalidRequest(str(exc)), "voice") from None
        frames = speech.talker.max_tokens
        if frames is not None and frames > MAX_AUDIO_FRAMES:
            raise _about(
                InvalidRequest(f"max_frames must be at most {MAX_AUDIO_FRAMES:,} (327.7 s), got {frames:,}"),
                "max_frames",
            )
        if speech.reply_token_ids is None:
            max_tokens = self.thinker.validate(prompt_token_ids, params)
            text_tokens = max_tokens
        else:
            if not speech.reply_token_ids:
                raise _about(InvalidRequest("there is no text to speak"), "text")
            try:
                max_tokens = self.thinker.validate(prompt_token_ids, SamplingParams(max_tokens=1))
            except InvalidRequest as exc:  # the prompt is the text, as the user's turn
                raise _about(exc, "text") from None
            text_tokens = len(speech.reply_token_ids)
        ids = torch.tensor(prompt_token_ids)
        tokens = self.speech_stages.tokens
        if len(ids) < 3 or ids[-3:].tolist() != [tokens.im_start, tokens.assistant, ids[-1].item()]:
            raise InvalidRequest(
                "a spoken reply needs a chat prompt that ends by opening the assistant's turn"
            )
        talker_prompt_len = int(user_turn_mask(ids, tokens).sum()) + ASSISTANT_ROWS
        try:
            self.speech_stages.talker_stage.pool.check_admissible(
                talker_prompt_len + self._frame_cap(speech, text_tokens)
            )
        except RequestTooLarge as exc:
            raise _about(exc, "text" if frames is None else "max_frames") from None
        return ValidRequest(request, max_tokens)

    def _frame_cap(self, speech: SpeechParams, text_tokens: int) -> int:
        return speech.talker.max_tokens or default_frame_cap(text_tokens)

    def add_requests(self, requests: Sequence[GenerationRequest]) -> list[Exception | None]:
        """Admit several requests (their media encoded together); per request, None or what kept it out. Each
        is validated once, here; a speaking request then waits its turn if max_speaking already speak."""
        errors: list[Exception | None] = [None] * len(requests)
        index = {r.request_id: i for i, r in enumerate(requests)}
        text_requests = []
        for i, r in enumerate(requests):
            try:
                valid = self.validate(r)
            except Exception as exc:
                errors[i] = exc
                continue
            if r.speech is None:
                text_requests.append(valid)
            else:
                self._waiting.append(_Waiting(valid, time.monotonic()))
        for request_id, error in self._admit(text_requests, set(index)).items():
            errors[index[request_id]] = error
        return errors

    def _admit(
        self, text_requests: list[ValidRequest], batch: Collection[str] = frozenset()
    ) -> dict[str, Exception]:
        """Text requests, and the waiting speaking ones while fewer than max_speaking speak, to the Thinker in
        one call; what kept out each of `batch` (the ids being added). One refused that waited from an earlier
        batch ends in the next step's outputs."""
        thinker_requests = [NewRequest.of(valid) for valid in text_requests]
        while self._waiting and len(self._speaking) < self.max_speaking:
            waiting = self._waiting.popleft()
            r = waiting.valid.request
            assert r.speech is not None  # only speaking requests wait
            speech = self._new_speech(r, waiting.valid.max_tokens, waiting.arrival)
            if r.speech.reply_token_ids is None:
                thinker_requests.append(NewRequest.of(waiting.valid, speech.tap))
            self._speaking[r.request_id] = speech
        errors = {}
        for r, error in zip(
            thinker_requests, self.thinker.add_requests(thinker_requests) if thinker_requests else []
        ):
            if error is None:
                continue
            refused = self._speaking.pop(r.request_id, None)
            if r.request_id in batch:
                errors[r.request_id] = error
            elif refused is not None:
                self._refused.append(_failed(refused.text, f"{type(error).__name__}: {error}"))
        return errors

    def _new_speech(self, r: GenerationRequest, max_tokens: int, arrival: float) -> Speech:
        # a speaking request, to a pipeline that speaks
        assert self.speech_stages is not None and r.speech is not None
        ids = torch.tensor(r.prompt_token_ids)
        media_rows = torch.isin(ids, torch.tensor(self.speech_stages.tokens.placeholders)).nonzero()[:, 0]
        tap = None
        if len(media_rows) and r.speech.reply_token_ids is None:
            width = self.model_config.thinker.text.hidden_size
            tap = HiddenTap(
                self.model_config.talker.accept_hidden_layer,
                media_rows.to(self.device),
                torch.zeros(len(media_rows), width, dtype=self.dtype, device=self.device),
                media_rows.numpy(),
            )
        reply = r.speech.reply_token_ids
        text = RequestOutput(
            r.request_id,
            r.prompt,
            r.prompt_token_ids,
            [CompletionOutput(0, "", [])],
            metrics={"arrival": arrival},
        )
        speech = Speech(
            request_id=r.request_id,
            params=r.speech,
            speaker=self.speech_stages.tokens.speaker_id(r.speech.voice),
            prompt_ids=list(r.prompt_token_ids),
            media=MediaLayout.of(r.mm, self.model_config.thinker),
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
        for waiting in self._waiting:
            if waiting.valid.request.request_id == request_id:
                self._waiting.remove(waiting)
                r = waiting.valid.request
                text = RequestOutput(
                    r.request_id, r.prompt, r.prompt_token_ids, [CompletionOutput(0, "", [])]
                )
                return replace(text, outputs=[replace(text.outputs[0], finish_reason="abort")], finished=True)
        speech = self._speaking.pop(request_id, None)
        if speech is not None and self.speech_stages is not None:
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
        return self.thinker.has_unfinished() or bool(self._speaking or self._waiting or self._refused)

    @property
    def num_waiting(self) -> int:
        """Requests not started: the Thinker's, and the speaking ones waiting for their turn."""
        return self.thinker.num_waiting + len(self._waiting)

    def stats(self) -> dict[str, int]:
        stats = self.thinker.stats()
        stats["num_waiting"] = self.num_waiting
        if self.speech_stages is not None:
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
        if self._waiting and len(self._speaking) < self.max_speaking:
            self._admit([])
        outputs, self._refused = self._refused, []
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
        self, thinker_outputs: list[RequestOutput], outputs: list[RequestOutput], touched: dict[str, Speech]
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

    def _on_text(self, speech: Speech, out: RequestOutput) -> None:
        assert self.speech_stages is not None  # a speaking request's text
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
                self.handoff.end_talker(speech)

    def _fail(self, speech: Speech, error: str) -> None:
        assert self.speech_stages is not None  # a speaking request's failure
        speech.error = error
        if self._deferred_aborts is not None:  # the Thinker is mid-step on its thread
            self._deferred_aborts.append(speech.request_id)
        else:
            self.thinker.abort(speech.request_id)
        self.speech_stages.talker_stage.abort(speech.request_id)
        self.speech_stages.streamer.cancel(speech.request_id)

    def _speak(self) -> dict[str, list[np.ndarray]]:
        assert self.speech_stages is not None  # requests speak
        with torch.inference_mode(), self.speech_stages.on_device():
            return self.handoff.step()

    def _output(self, speech: Speech, chunks: list[np.ndarray]) -> RequestOutput:
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


def _failed(text: RequestOutput, error: str) -> RequestOutput:
    completion = replace(text.outputs[0], finish_reason="error", delta_text="", delta_token_ids=[])
    return replace(text, outputs=[completion], finished=True, error=error)
