"""Qwen3-Omni's tokenizer files: the Qwen vocabulary (`models/qwen_tokenizer.py`) with Qwen3-Omni's special
tokens on top at fixed ids, so tiny checkpoints speak the real vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from omnistage.models import qwen_tokenizer
from omnistage.models.qwen_tokenizer import NOT_SPECIAL, chat_template

SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
    151669: "<|audio_start|>",
    151670: "<|audio_end|>",
    151671: "<tts_pad>",
    151672: "<tts_text_bos>",
    151673: "<tts_text_eod>",
    151674: "<tts_text_bos_single>",
    151675: "<|audio_pad|>",
}

# Content parts become framed placeholders; the processor expands each pad to the encoder's token count.
CHAT_TEMPLATE = chat_template(
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
)


def build_tokenizer() -> Tokenizer:
    """The Qwen byte-level BPE over the packaged vocabulary, with Qwen3-Omni's special tokens at their ids."""
    return qwen_tokenizer.build_tokenizer(SPECIAL_TOKENS, NOT_SPECIAL)


def write_tokenizer_files(directory: Path, template: str = CHAT_TEMPLATE) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (`template`) as a released
    checkpoint has them."""
    qwen_tokenizer.write_tokenizer(directory, dict(sorted(SPECIAL_TOKENS.items())), NOT_SPECIAL, template)
