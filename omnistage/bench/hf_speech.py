"""transformers' `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)` on our pipeline's very
weights: the baseline of `omnistage bench t2s` and `omnistage bench s2s`.

The whole model is built on the meta device. Its Thinker is `hf_baseline.build_hf_thinker`'s (text weights
shared, towers filled from our encoders); the talker, its code predictor and Code2Wav get our pipeline's
tensors as their parameters (shared storage, no copy; only the fused experts carry other names), and the
buffers a meta build leaves empty (rotary frequencies, Code2Wav's codebook offsets) are made again.

Lengths are forced as ours are: `thinker_min_new_tokens` and `talker_min_new_tokens` hold each EOS back
until the cap. The talker's last step samples a code 0 that no frame follows, so F frames take
`talker_max_new_tokens=F + 1`. transformers does not stream audio: `generate` returns the waveform when all
is done, so its first audio packet is its whole time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from omnistage.bench.hf_baseline import _RENAMES, _sync, build_hf_thinker, omni_features, prompt_inputs
from omnistage.bench.hf_layout import audio_tower
from omnistage.bench.speech_targets import SpeechInput, SpeechTiming
from omnistage.outputs import AUDIO_SAMPLE_RATE

log = logging.getLogger(__name__)


def build_hf_omni(pipeline: Any, config_dict: dict) -> tuple[torch.nn.Module, dict[str, str]]:
    """transformers' whole model on `pipeline`'s weights; also says where the Thinker's towers came from."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    # Any: its sub-configs are typed `dict | PreTrainedConfig | None`
    config: Any = Qwen3OmniMoeConfig(**config_dict)
    talker = config.talker_config
    for sub in (config, talker, talker.text_config, talker.code_predictor_config, config.code2wav_config):
        sub._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3OmniMoeForConditionalGeneration(config)
    hf.thinker, sources = build_hf_thinker(pipeline.thinker, config_dict)
    share_parameters(hf.talker, pipeline.speech_stages.talker, skip="code_predictor.")
    share_parameters(hf.talker.code_predictor, pipeline.speech_stages.code_predictor)
    share_parameters(hf.code2wav, pipeline.speech_stages.code2wav)
    with torch.device(pipeline.device):  # a meta build leaves these buffers empty: make them again
        for owner in (hf.talker.model, hf.talker.code_predictor.model, hf.code2wav.pre_transformer):
            owner.rotary_emb = type(owner.rotary_emb)(owner.rotary_emb.config)
        c2w = config.code2wav_config
        hf.code2wav.code_offset = torch.arange(c2w.num_quantizers).view(1, -1, 1) * c2w.codebook_size
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return hf.eval(), sources


def share_parameters(theirs: torch.nn.Module, ours: torch.nn.Module, skip: str | None = None) -> None:
    """Set every parameter of `theirs` (but those under `skip`) to our tensor of the same checkpoint name."""
    mine = dict(ours.named_parameters())
    for name, param in list(theirs.named_parameters()):
        if skip is not None and name.startswith(skip):
            continue
        our_name = name
        for their_part, our_part in _RENAMES:
            our_name = our_name.replace(their_part, our_part)
        if our_name not in mine:
            raise RuntimeError(
                f"transformers' {name} has no counterpart ({our_name}) in our {type(ours).__name__}"
            )
        if tuple(mine[our_name].shape) != tuple(param.shape):
            raise RuntimeError(f"{name}: ours {tuple(mine[our_name].shape)} vs theirs {tuple(param.shape)}")
        module_name, _, leaf = name.rpartition(".")
        owner = theirs.get_submodule(module_name) if module_name else theirs
        setattr(owner, leaf, torch.nn.Parameter(mine[our_name], requires_grad=False))


@contextmanager
def counting_frames(hf: Any) -> Iterator[list[int]]:
    """The frames of each talker run inside the block (a talker step that carries a frame has its codes as
    its last hidden state, as transformers' generate reads them)."""
    counts: list[int] = []
    generate = hf.talker.generate

    def counted(**kwargs: Any) -> Any:
        result = generate(**kwargs)
        counts.append(sum(step[-1] is not None for step in result.hidden_states))
        return result

    hf.talker.generate = counted
    try:
        yield counts
    finally:
        del hf.talker.generate


def forced_generate(
    hf: Any, inputs: dict[str, Any], voice: str, text: int, audio: int, eos: int, streamer: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' spoken reply to `inputs`, `text` greedy tokens and `audio` frames exactly (random weights
    never stop on their own): its sequences and waveform. The Talker's budget counts code-0 tokens, one more
    than the frames it makes (README, "Speech out")."""
    return hf.generate(
        **inputs,
        return_audio=True,
        speaker=voice,
        thinker_max_new_tokens=text,
        thinker_min_new_tokens=text,
        thinker_do_sample=False,
        thinker_eos_token_id=eos,
        thinker_streamer=streamer,
        talker_max_new_tokens=audio + 1,
        talker_min_new_tokens=audio + 1,
    )


@torch.inference_mode()
def run_hf_speech(
    hf: Any,
    processor: Any,
    inputs: list[SpeechInput],
    text_tokens: int,
    frames: int,
    voice: str,
    requests: int,
) -> list[SpeechTiming]:
    """`requests` requests over `inputs`, one at a time, each timed from its prompt to its waveform."""
    device = hf.thinker.device
    eos = processor.tokenizer.token_to_id("<|im_end|>")
    prompts = [processor.process_chat(item.messages()).token_ids for item in inputs]

    def generate(item: SpeechInput, ids: list[int], text: int, audio: int) -> SpeechTiming:
        _sync(device)
        start = time.perf_counter()
        kwargs: dict[str, Any] = prompt_inputs(ids, device)
        if item.clip is not None:  # the mel features are computed inside the timing, as ours are
            kwargs |= omni_features(item.clip.audio, audio_tower(hf.thinker).dtype, device)
        with counting_frames(hf) as counts:
            sequences, waveform = forced_generate(hf, kwargs, voice, text, audio, eos)
        _sync(device)
        end = time.perf_counter()
        seconds = waveform.shape[-1] / AUDIO_SAMPLE_RATE
        return SpeechTiming(end - start, end - start, seconds, counts[0], sequences.shape[1] - len(ids))

    generate(inputs[0], prompts[0], min(text_tokens, 4), min(frames, 4))  # warm-up
    timings = []
    for i in range(requests):
        t = generate(inputs[i % len(inputs)], prompts[i % len(inputs)], text_tokens, frames)
        log.info("transformers: %s: %d text tokens, %d frames (%.2f s of audio) in %.2f s", inputs[i % len(inputs)].name,
                 t.text_tokens, t.frames, t.audio_s, t.latency_s)  # fmt: skip
        timings.append(forced(t, text_tokens, frames))
    return timings


def forced(t: SpeechTiming, text_tokens: int, frames: int) -> SpeechTiming:
    """`t`, once it made the lengths forced on it: any other length would time another request."""
    if t.frames != frames or t.text_tokens != text_tokens:
        raise RuntimeError(
            f"transformers made {t.text_tokens} text tokens and {t.frames} frames, "
            f"not the {text_tokens} and {frames} forced"
        )
    return t
