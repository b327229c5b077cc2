"""transformers' Qwen3-Omni Thinker on our engine's very weight tensors, timed on the same clips.

The text model is built on the meta device and its parameters are set to our engine's tensors (shared
storage, no copy), as `benchmarks/thinker_decode.py` does; the audio and vision towers are built for
real and filled from our encoders where the engine exposes them (`engine.encoders.audio_encoder`,
`engine.encoders.vision_encoder`), else left at transformers' random init. Requests run one at a time through
`generate(input_features=..., feature_attention_mask=...)`, timed from the raw clip (the mel features
are computed inside the timing) to the first generated token (a streamer sees it) and to the last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from omnistage.bench.clips import Clip, total_seconds
from omnistage.bench.hf_layout import audio_tower, parts, released_name, text_model, visual
from omnistage.bench.stats import RequestTiming, summarize

log = logging.getLogger(__name__)

# Our fused expert tensors under transformers' names.
_RENAMES = ((".experts.gate_up_proj", ".experts.w13"), (".experts.down_proj", ".experts.w2"))


def build_hf_thinker(engine: Any, config_dict: dict) -> tuple[torch.nn.Module, dict[str, str]]:
    """transformers' thinker sharing `engine`'s text weights; also says where each tower's weights came from."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeThinkerForConditionalGeneration,
        Qwen3OmniMoeVisionEncoder,
    )

    device, dtype = engine.device, engine.dtype
    # Any: transformers types it `dict | PreTrainedConfig | None`
    config: Any = Qwen3OmniMoeConfig(**config_dict).thinker_config
    for sub in (config, config.text_config, config.audio_config, config.vision_config):
        sub._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    ours = dict(engine.model.named_parameters())
    for name, param in list(hf.named_parameters()):
        mine = released_name(name)
        if mine.startswith(("audio_tower.", "visual.")):
            continue
        for theirs, our_name in _RENAMES:
            mine = mine.replace(theirs, our_name)
        if mine not in ours:
            raise RuntimeError(f"transformers' {name} has no counterpart ({mine}) in our thinker")
        if tuple(ours[mine].shape) != tuple(param.shape):
            raise RuntimeError(f"{name}: ours {tuple(ours[mine].shape)} vs theirs {tuple(param.shape)}")
        module_name, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(module_name), leaf, torch.nn.Parameter(ours[mine], requires_grad=False))
    with torch.device(device):  # a meta build leaves the rotary frequencies empty: make them again
        text = text_model(hf)
        text.rotary_emb = type(text.rotary_emb)(text.rotary_emb.config)
        parts(hf).audio_tower = Qwen3OmniMoeAudioEncoder._from_config(config.audio_config).to(dtype)
        parts(hf).visual = Qwen3OmniMoeVisionEncoder._from_config(config.vision_config).to(dtype)
    sources = {
        "audio_tower": _fill_tower(audio_tower(hf), getattr(engine.encoders, "audio_encoder", None)),
        "visual": _fill_tower(visual(hf), getattr(engine.encoders, "vision_encoder", None)),
    }
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return hf.eval(), sources


@torch.no_grad()
def _fill_tower(tower: torch.nn.Module, ours: torch.nn.Module | None) -> str:
    """Copy our encoder's weights into transformers' tower (same names, as the checkpoint spells them)."""
    if ours is None:
        return "random (the engine exposes no encoder)"
    mine = dict(ours.named_parameters())
    for name, param in tower.named_parameters():
        if name not in mine or tuple(mine[name].shape) != tuple(param.shape):
            return f"random (our encoder has no matching {name})"
        param.copy_(mine[name])
    return "shared with ours"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_inputs(ids: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """One prompt as transformers' generate takes it: its ids, and an attention mask over all of them."""
    return {
        "input_ids": torch.tensor([ids], device=device),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device),
    }


def omni_features(audio: np.ndarray, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """A clip as Qwen3-Omni's audio tower takes it in transformers: its mel features, all of them valid."""
    from omnistage.models.qwen3_omni.audio_features import log_mel

    features = log_mel(audio, device=device).to(device)
    return {
        "input_features": features[None].to(dtype),
        "feature_attention_mask": torch.ones(1, features.shape[-1], dtype=torch.long, device=device),
    }


def timed_generate(
    hf: Any,
    clip: Clip,
    ids: list[int],
    new_tokens: int,
    min_new: dict[str, int],
    *,
    eos: int,
    device: torch.device,
    audio_inputs: Callable[[np.ndarray], dict[str, torch.Tensor]],
) -> RequestTiming:
    """One greedy request through transformers' generate, timed from the raw clip (`audio_inputs` makes its
    features inside the timing, as ours are made) to the first generated token (a streamer sees it) and to
    the last."""
    first = _FirstToken(device)
    _sync(device)
    start = time.perf_counter()
    out = hf.generate(
        **prompt_inputs(ids, device),
        **audio_inputs(clip.audio),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        streamer=first,
        **min_new,
    )
    _sync(device)
    end = time.perf_counter()
    return RequestTiming(clip.seconds, (first.at or end) - start, end - start, out.shape[1] - len(ids))


@torch.inference_mode()
def run_hf(
    hf: Any,
    eos: int,
    clips: list[Clip],
    prompts: list[list[int]],
    audio_inputs: Callable[[np.ndarray], dict[str, torch.Tensor]],
    output_tokens: int | None,
    max_tokens: int,
    device: torch.device,
    repeats: int = 1,
) -> dict[str, Any]:
    """One warm-up request, then `repeats` passes of every clip, one at a time (`timed_generate`, ending on
    `eos`): the c=1 summary of transformers. `prompts` are the clips' prompt ids, `audio_inputs` the features
    the model's generate takes of a clip."""
    generate = partial(timed_generate, hf, eos=eos, device=device, audio_inputs=audio_inputs)
    fixed = {"min_new_tokens": output_tokens} if output_tokens else {}
    new_tokens = output_tokens or max_tokens
    generate(clips[0], prompts[0], min(new_tokens, 4), {})  # warm-up
    timings, walls = [], []
    for _ in range(repeats):
        for clip, ids in zip(clips, prompts):
            t = generate(clip, ids, new_tokens, {k: v for k, v in fixed.items() if v <= new_tokens})
            timings.append(t)
            log.info("transformers: %s (%.1f s) TTFT %.1f ms, %d tokens in %.3f s", clip.name, clip.seconds,
                     t.ttft_s * 1e3, t.output_tokens, t.latency_s)  # fmt: skip
        walls.append(sum(t.latency_s for t in timings[-len(clips) :]))
    summary: dict[str, Any] = summarize(timings, walls, 1)
    summary["note"] = (
        f"one request at a time over {total_seconds(clips):.1f} s of audio; wall = sum of latencies"
    )
    return summary


class _FirstToken:
    """A generate() streamer noting when the first generated token arrives (its first put is the prompt)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            _sync(self.device)
            self.at = time.perf_counter()

    def end(self) -> None:
        pass
