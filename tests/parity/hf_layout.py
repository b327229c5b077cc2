"""Where transformers keeps the Thinker's parts. 5.17 holds the audio tower, the vision tower and the text model
(as `model`) on Qwen3OmniMoeThinkerForConditionalGeneration itself; 5.24 moves all three into a
Qwen3OmniMoeThinkerModel at `model`, the text model as `model.language_model`."""

from __future__ import annotations

from torch import nn


def _parts(thinker) -> nn.Module:
    return thinker.model if hasattr(thinker.model, "language_model") else thinker


def text_model(thinker) -> nn.Module:
    """The Thinker's text decoder (Qwen3OmniMoeThinkerTextModel)."""
    return getattr(thinker.model, "language_model", thinker.model)


def audio_tower(thinker) -> nn.Module:
    return _parts(thinker).audio_tower


def visual(thinker) -> nn.Module:
    return _parts(thinker).visual


def rope_deltas(thinker):
    """The M-RoPE delta of the last prompt generate() laid out."""
    return _parts(thinker).rope_deltas
