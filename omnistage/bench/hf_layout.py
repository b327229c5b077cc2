"""Where transformers keeps the Thinker's parts. 5.17 holds the audio tower, the vision tower and the text model
(as `model`) on Qwen3OmniMoeThinkerForConditionalGeneration itself; 5.24 moves all three into a
Qwen3OmniMoeThinkerModel at `model`, the text model as `model.language_model`, and their parameter names
gain that `model.`. The bench baselines and the parity tests reach them through here under either version."""

from __future__ import annotations

from typing import Any

# 5.24's parameter name prefixes, and the released checkpoint's (5.17's) for the same tensors.
_MOVED = (
    ("model.language_model.", "model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.visual.", "visual."),
)


# transformers' modules are typed `Any` here: torch types a submodule attribute as `Tensor | Module`, which
# hides the model classes' own attributes (`generate`, `dtype`, `rope_deltas`).


def parts(thinker: Any) -> Any:
    """The module holding `audio_tower`, `visual` and `rope_deltas`: the Thinker itself under 5.17."""
    return thinker.model if hasattr(thinker.model, "language_model") else thinker


def text_model(thinker: Any) -> Any:
    """The Thinker's text decoder (Qwen3OmniMoeThinkerTextModel)."""
    return getattr(thinker.model, "language_model", thinker.model)


def audio_tower(thinker: Any) -> Any:
    return parts(thinker).audio_tower


def visual(thinker: Any) -> Any:
    return parts(thinker).visual


def rope_deltas(thinker: Any) -> Any:
    """The M-RoPE delta of the last prompt generate() laid out."""
    return parts(thinker).rope_deltas


def released_name(name: str) -> str:
    """A Thinker parameter's name as the released checkpoint (and 5.17) spells it."""
    for moved, released in _MOVED:
        if name.startswith(moved):
            return released + name[len(moved) :]
    return name
