"""A stage's outputs beside the stage, as vLLM v1 keeps them: each sampled id checked against the request's
stops and detokenized (`stop_and_text`), and the RequestOutput its caller gets (`request_output`). The state the
stage keeps per request (`RequestState`, made by `request_state`) holds the detokenizer and the stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from omnistage.engine.decode_ahead import decodes_ahead, drop_placeholders
from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.sampling import make_generator
from omnistage.engine.sequence import PromptInputs, Sequence, SequenceStatus
from omnistage.engine.stages.autoregressive import SamplingState
from omnistage.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from omnistage.request import GenerationRequest

if TYPE_CHECKING:
    from omnistage.engine.stages.encoders import MultimodalEmbeds
    from omnistage.engine.stages.token_runner import HiddenTap
    from omnistage.engine.structured import GrammarState

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(kw_only=True)
class RequestState(PromptInputs, SamplingState):
    """What the stage keeps per request beside the scheduler's Sequence; its `mm`, the encoder outputs for the
    prompt's placeholders, until it finishes."""

    prompt: str | None
    detokenizer: IncrementalDetokenizer
    decodes_ahead: bool = False  # decode_ahead.decodes_ahead
    # only its finished output is wanted: its caller asked for that alone (final_only) and no later stage reads
    # its text as it comes (a spoken reply's feeds the Talker)
    final_only: bool = False
    # its tokens per output while it streams (`EngineSettings.stream_interval`; 1 where a stage reads its text)
    stream_interval: int = 1
    stop_reason: int | str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # each output token's, where the request asked; else None
    # the deltas of the tokens since its last output, which its next output carries (`hold`)
    held_text: str = ""
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def hold(self, text: str, token: int, logprobs: TokenLogprobs | None) -> None:
        """Keep a token's deltas for the request's next output."""
        self.held_text += text
        self.held_ids.append(token)
        if logprobs is not None:
            self.held_logprobs.append(logprobs)


def request_state(
    request: GenerationRequest,
    mm: MultimodalEmbeds | None,
    tap: HiddenTap | None,
    tokenizer: Tokenizer,
    eos_token_ids: list[int],
    device: torch.device,
    grammar: GrammarState | None = None,
    stream_interval: int = 1,
) -> RequestState:
    """A new request's state: its detokenizer and stops, its seeded generator on `device`, and its encoder
    outputs `mm` for the prompt's placeholders and the `tap` a later stage reads; `eos_token_ids` are the model's
    end tokens; `grammar` its constraint's matcher, if it has one; `stream_interval` its tokens per output,
    unless its text feeds a later stage."""
    params = request.params
    return RequestState(
        params=params,
        prompt=request.prompt,
        detokenizer=IncrementalDetokenizer(
            tokenizer,
            params.skip_special_tokens,
            params.stop or [],
            params.include_stop_str_in_output,
        ),
        generator=make_generator(params, device),
        eos_token_ids=[] if params.ignore_eos else eos_token_ids,
        grammar=grammar,
        mrope=request.mrope,
        mm=mm,
        tap=tap,
        decodes_ahead=decodes_ahead(params, feeds_a_stage=request.speech is not None),
        final_only=request.final_only and request.speech is None,
        stream_interval=stream_interval if request.speech is None else 1,
        logprobs=[] if params.logprobs is not None else None,
    )


def stop_and_text(state: RequestState, token: int) -> tuple[SequenceStatus | None, str]:
    """A sampled id against the request's stops (its stop ids, the model's end tokens, its stop strings, its
    grammar's end): the status it ends the request with, if it does, and the text it adds."""
    if state.grammar is not None:
        state.grammar.accept(token)
    status, delta = _stop_and_text(state, token)
    if status is None and state.grammar is not None and state.grammar.done:
        return SequenceStatus.FINISHED_STOPPED, delta
    return status, delta


def _stop_and_text(state: RequestState, token: int) -> tuple[SequenceStatus | None, str]:
    if token in (state.params.stop_token_ids or ()):
        state.stop_reason = token
        return SequenceStatus.FINISHED_STOPPED, ""
    if token in state.eos_token_ids:
        return SequenceStatus.FINISHED_STOPPED, ""
    delta = state.detokenizer.add(token)
    if state.detokenizer.stopped:
        state.stop_reason = state.detokenizer.stop_str
        return SequenceStatus.FINISHED_STOPPED, delta
    return None, delta


def request_output(
    seq: Sequence[RequestState],
    delta_text: str,
    delta_ids: list[int],
    delta_logprobs: list[TokenLogprobs] | None = None,
) -> RequestOutput:
    """What the caller gets of `seq` after a step: its delta (after the deltas held since its last output) and,
    once it finished, all of it."""
    state = seq.data
    if state.held_ids:
        delta_text, state.held_text = state.held_text + delta_text, ""
        delta_ids, state.held_ids = state.held_ids + delta_ids, []
        delta_logprobs, state.held_logprobs = state.held_logprobs + (delta_logprobs or []), []
    finished = seq.is_finished
    if finished:
        drop_placeholders(seq.output_token_ids)  # ended with a token in flight (aborted, failed)
        state.metrics.setdefault("finished", time.monotonic())
        state.mm = None
    completion = CompletionOutput(
        index=0,
        text=state.detokenizer.text,
        token_ids=list(seq.output_token_ids),
        finish_reason=_FINISH_REASONS.get(seq.status) if finished else None,
        stop_reason=state.stop_reason,
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        logprobs=list(state.logprobs) if state.logprobs is not None else None,
        delta_logprobs=delta_logprobs or [],
    )
    return RequestOutput(
        request_id=seq.request_id,
        prompt=state.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        error=state.error,
        metrics=dict(state.metrics),
    )
