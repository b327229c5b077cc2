"""The chat templates of Qwen3-Omni's released checkpoints, by variant, as the tiny checkpoints carry them."""

from __future__ import annotations

from omnistage.models.qwen3_omni.tokenizer import CHAT_TEMPLATE

VARIANTS = ("instruct", "thinking", "captioner")


def chat_template(variant: str = "instruct") -> str:
    """The chat template the released `variant` checkpoint ships."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen3-Omni variant {variant!r}; one of {', '.join(VARIANTS)}")
    return CHAT_TEMPLATE
