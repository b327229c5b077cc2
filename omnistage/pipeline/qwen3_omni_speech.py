"""What Qwen3-Omni's pipeline does with a speaking request before its stages run it: the checks only the speech
stages can make (a voice, the Talker's pool, the frame cap), the frame cap a request that sets none gets, how
many speak at once, and the state a request speaks with (`Speech`)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch

from omnistage.config import EngineConfig
from omnistage.engine.stages.text import TextStage
from omnistage.engine.stages.token_runner import HiddenTap
from omnistage.errors import InvalidRequest, RequestTooLarge
from omnistage.models.layers.attention_metadata import to_device
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.talker_input import ASSISTANT_ROWS, user_turn_mask
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.handoff import Speech
from omnistage.pipeline.speech_stages import SpeechStages
from omnistage.request import MAX_AUDIO_FRAMES, GenerationRequest, SamplingParams, SpeechParams, ValidRequest

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


def about(exc: InvalidRequest, field: str) -> InvalidRequest:
    """`exc`, marked with the part of a speaking request it is about (`max_frames`, `text`: the reply's length,
    `voice`), which the server spells as the route's field (server/errors.py)."""
    exc.field = field
    return exc


def frame_cap(speech: SpeechParams, text_tokens: int) -> int:
    return speech.talker.max_tokens or default_frame_cap(text_tokens)


def validate_speech(
    stages: SpeechStages | None, thinker: TextStage, request: GenerationRequest, speech: SpeechParams
) -> ValidRequest:
    """A speaking request checked against the Thinker and the speech stages, once."""
    prompt_token_ids, params = request.prompt_token_ids, request.params
    if stages is None:
        raise InvalidRequest(
            "this server does not speak: the checkpoint has no talker, or speech is off in its config"
        )
    try:
        stages.tokens.speaker_id(speech.voice)
    except ValueError as exc:
        raise about(InvalidRequest(str(exc)), "voice") from None
    frames = speech.talker.max_tokens
    if frames is not None and frames > MAX_AUDIO_FRAMES:
        raise about(
            InvalidRequest(f"max_frames must be at most {MAX_AUDIO_FRAMES:,} (327.7 s), got {frames:,}"),
            "max_frames",
        )
    if speech.reply_token_ids is None:
        max_tokens = thinker.validate(prompt_token_ids, params)
        text_tokens = max_tokens
    else:
        if not speech.reply_token_ids:
            raise about(InvalidRequest("there is no text to speak"), "text")
        try:
            max_tokens = thinker.validate(prompt_token_ids, SamplingParams(max_tokens=1))
        except InvalidRequest as exc:  # the prompt is the text, as the user's turn
            raise about(exc, "text") from None
        text_tokens = len(speech.reply_token_ids)
    ids = torch.tensor(prompt_token_ids)
    tokens = stages.tokens
    if len(ids) < 3 or ids[-3:].tolist() != [tokens.im_start, tokens.assistant, ids[-1].item()]:
        raise InvalidRequest("a spoken reply needs a chat prompt that ends by opening the assistant's turn")
    talker_prompt_len = int(user_turn_mask(ids, tokens).sum()) + ASSISTANT_ROWS
    try:
        stages.talker_stage.pool.check_admissible(talker_prompt_len + frame_cap(speech, text_tokens))
    except RequestTooLarge as exc:
        raise about(exc, "text" if frames is None else "max_frames") from None
    return ValidRequest(request, max_tokens)


def new_speech(
    stages: SpeechStages,
    cfg: Qwen3OmniConfig,
    processor: Processor,
    r: GenerationRequest,
    max_tokens: int,
    arrival: float,
    device: torch.device,
    dtype: torch.dtype,
) -> Speech:
    """A validated speaking request's state: its Talker's seed and cap, and the Thinker's hidden states of its
    media rows that the Talker reads (`tap`), on the Thinker's `device` in its `dtype`."""
    assert r.speech is not None
    ids = torch.tensor(r.prompt_token_ids)
    media_rows = torch.isin(ids, torch.tensor(stages.tokens.placeholders)).nonzero()[:, 0]
    tap = None
    if len(media_rows) and r.speech.reply_token_ids is None:
        width = cfg.thinker.text.hidden_size
        tap = HiddenTap(
            cfg.talker.accept_hidden_layer,
            to_device(media_rows, device),  # pinned: a pageable copy would wait for the queued steps
            torch.zeros(len(media_rows), width, dtype=dtype, device=device),
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
        speaker=stages.tokens.speaker_id(r.speech.voice),
        prompt_ids=list(r.prompt_token_ids),
        media=MediaLayout.of(r.mm, cfg.thinker),
        frame_cap=frame_cap(r.speech, len(reply) if reply is not None else max_tokens),
        tap=tap,
        text=text,
        # an unseeded request's draws still differ from every other's
        predictor_seed=seed if (seed := r.speech.talker.seed) is not None else random.getrandbits(63),
    )
    if reply is not None:  # the reply is given: it is all known, and its end is the unspoken last token
        speech.generated = [*reply, cfg.im_end_token_id]
        speech.text_done = True
        completion = CompletionOutput(
            0,
            processor.decode(reply),
            list(reply),
            finish_reason="stop",
            delta_text="",
            delta_token_ids=[],
        )
        speech.text = replace(text, outputs=[completion], finished=True)
    return speech


def failed(text: RequestOutput, error: str) -> RequestOutput:
    completion = replace(
        text.outputs[0], finish_reason="error", delta_text="", delta_token_ids=[], delta_logprobs=[]
    )
    return replace(text, outputs=[completion], finished=True, error=error)


def speech_output(speech: Speech, chunks: list[np.ndarray]) -> RequestOutput:
    """A speaking request's output of a step: its text so far, the PCM of `chunks` with the frames they complete,
    and once it ends its whole audio and codes."""
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
        spoken_frames=speech.spoken_frames[speech.frames_reported :],
    )
    speech.frames_reported = len(speech.spoken_frames)
    speech.text = replace(
        text, outputs=[replace(text.outputs[0], delta_text="", delta_token_ids=[], delta_logprobs=[])]
    )
    speech.audio += chunks
    if speech.first_audio:
        out.metrics = {**out.metrics, "first_audio": speech.first_audio}
    if finished:
        out.audio = np.concatenate(speech.audio) if speech.audio else np.zeros(0, dtype=np.float32)
        out.audio_codes = torch.stack(speech.codes).tolist() if speech.codes else []
    return out
