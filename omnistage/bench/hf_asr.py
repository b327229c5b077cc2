"""transformers' Qwen3-ASR on our engine's very weight tensors, timed on the same clips (the a2t baseline).

transformers 5.17 reads only its own `-hf` config layout, so its config is converted from the released one
(`models/qwen3_asr/tiny.hf_config`); its model is built on the meta device and every parameter is pointed at
ours (no copy) through the released tensor names both sides share. Requests run one at a time through
`generate(input_ids, input_features, input_features_mask)` (`hf_baseline.run_hf`), timed from the raw clip
(the mel features are computed inside the timing) to the first generated token and to the last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def build_hf_asr(stage: Any, config_dict: dict) -> torch.nn.Module:
    """transformers' Qwen3ASRForConditionalGeneration sharing `stage`'s decoder and audio tower (a TextStage
    of a Qwen3-ASR pipeline)."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    from omnistage.models.qwen3_asr.tiny import hf_config, released_name
    from omnistage.models.qwen3_omni.audio_encoder import sinusoids

    config = Qwen3ASRConfig(**(hf_config(config_dict) if "thinker_config" in config_dict else config_dict))
    with torch.device("meta"):
        hf = Qwen3ASRForConditionalGeneration(config)
    ours = {f"thinker.model.{n}": p for n, p in stage.model.model.named_parameters()}
    ours |= {f"thinker.lm_head.{n}": p for n, p in stage.model.lm_head.named_parameters()}
    ours |= {f"thinker.audio_tower.{n}": p for n, p in stage.encoders.audio_encoder.named_parameters()}
    for name, param in list(hf.named_parameters(remove_duplicate=False)):  # the tied head too
        mine = ours.get(released_name(name))
        if mine is None or tuple(mine.shape) != tuple(param.shape):
            raise RuntimeError(f"transformers' {name} has no counterpart of its shape in our Qwen3-ASR")
        module_name, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(module_name), leaf, torch.nn.Parameter(mine, requires_grad=False))
    device = stage.device
    for module_name, module in list(hf.named_modules()):  # meta-built buffers (rotary frequencies): again
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "config"):
            parent, _, leaf = module_name.rpartition(".")
            with torch.device(device):
                setattr(hf.get_submodule(parent) if parent else hf, leaf, type(module)(module.config))
    positions = hf.model.audio_tower.positional_embedding  # Whisper's sinusoids, which ours computes per call
    positions.positional_embedding = sinusoids(
        positions.length, positions.channels, positions.max_timescale
    ).to(device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return hf.eval()


def asr_features(hf: Any, device: torch.device) -> Callable[[np.ndarray], dict[str, torch.Tensor]]:
    """How a clip goes into transformers' Qwen3-ASR: its mel features padded to whole encoder chunks, and the
    mask of the frames that are the clip's."""
    from omnistage.models.qwen3_asr.audio_features import log_mel

    chunk = 2 * hf.config.audio_config.n_window

    def features(audio: np.ndarray) -> dict[str, torch.Tensor]:
        mel = log_mel(audio, device=device).to(device)
        frames = mel.shape[-1]
        padded = torch.nn.functional.pad(mel, (0, -frames % chunk))  # its encoder takes whole chunks
        mask = (torch.arange(padded.shape[-1], device=device) < frames).long()[None]
        return {"input_features": padded[None].to(hf.dtype), "input_features_mask": mask}

    return features
