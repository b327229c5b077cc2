"""Audio to the log-mel features Qwen3-ASR reads: Qwen3-Omni's Whisper mel, clips first padded to 0.5 s.

The released pipeline (`qwen-asr`, and transformers' `Qwen3ASRFeatureExtractor` after it) zero-pads any clip
shorter than 0.5 s to 0.5 s before the mel, and the padding counts as audio (it gets audio tokens). The mel
axis is then padded to whole 1 s chunks with zeros, which our encoder does per chunk already.
"""

from __future__ import annotations

from typing import overload

import numpy as np
import torch

from omnistage.models.qwen3_omni.audio_features import SAMPLE_RATE, clip_waveform
from omnistage.models.qwen3_omni.audio_features import log_mel as omni_log_mel

MIN_SAMPLES = SAMPLE_RATE // 2


@overload
def log_mel(waveform: torch.Tensor | np.ndarray, device: torch.device | str | None = ...) -> torch.Tensor: ...
@overload
def log_mel(
    waveform: list[torch.Tensor | np.ndarray], device: torch.device | str | None = ...
) -> list[torch.Tensor]: ...


def log_mel(
    waveform: torch.Tensor | np.ndarray | list[torch.Tensor | np.ndarray],
    device: torch.device | str | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Log-mel features [128, frames] of 16 kHz mono audio (a list gives a list, each clip on its own)."""
    if isinstance(waveform, list):
        return [log_mel(w, device) for w in waveform]
    return omni_log_mel(padded_clip(waveform), device)


def padded_clip(waveform: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The clip the mel reads: float32 mono, zero-padded to 0.5 s (`clip_waveform`'s checks, InvalidMedia)."""
    x = torch.as_tensor(waveform)
    if x.dim() == 1 and x.numel() < MIN_SAMPLES:
        x = torch.nn.functional.pad(x, (0, MIN_SAMPLES - x.numel()))
    return clip_waveform(x)
