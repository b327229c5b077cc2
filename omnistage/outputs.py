"""What the engine hands back per request, shaped like vLLM's outputs so users and tools feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

AUDIO_SAMPLE_RATE = 24_000  # speech out: float32 mono PCM at 24 kHz


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and, most likely first, the `SamplingParams.logprobs` most likely
    tokens' at its position: log_softmax of the model's raw logits, before logit bias, penalties and temperature
    (vLLM's default), so that they describe the model, whatever the sampling did with it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative text so far
    token_ids: list[int]  # cumulative generated ids (the stop or eos token included when one ended it)
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    # one per generated token (token_ids), where the request asked for them (SamplingParams.logprobs); else None
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)  # those of delta_token_ids


@dataclass(frozen=True)
class SpokenFrame:
    """One codec frame of a spoken reply, as its audio goes out: where its samples end in the reply's audio, and
    how many of the reply's text tokens the Talker had read when it made the frame (it reads one more with each
    frame until the text runs out), so that a client that stopped the audio there knows what text was said."""

    audio_end: int  # samples at 24 kHz from the start of the reply's audio
    text_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set with finish_reason "error": what went wrong inside the engine
    # monotonic seconds: arrival, encoded (media through the encoders), scheduled (first step), first_token,
    # finished
    metrics: dict[str, float] = field(default_factory=dict)
    # Speech out (requests with SpeechParams). The audio_delta chunks of a request, concatenated, are its audio.
    audio_delta: np.ndarray | None = None  # PCM new since the previous output, float32 mono at 24 kHz
    num_audio_frames: int = 0  # codec frames so far (12.5 per second of audio): the usage's audio tokens
    audio: np.ndarray | None = None  # on the finished output: the whole reply's PCM
    audio_codes: list[list[int]] | None = None  # on the finished output: num_code_groups codes per frame
    # the codec frames whose audio was completed by audio_delta, in order
    spoken_frames: list[SpokenFrame] = field(default_factory=list)
