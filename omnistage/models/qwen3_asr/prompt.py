"""The transcription prompt of Qwen3-ASR: an optional context as the system turn, one audio clip, and an
optional forced language as the start of the reply.

    <|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|>{N x <|audio_pad|>}<|audio_end|>
    <|im_end|>\n<|im_start|>assistant\n[language {Name}<asr_text>]

The system turn is there even without context, as the released model was trained. The model writes no
language token: the language is plain text, so forcing it is prefilling those words.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from omnistage.errors import InvalidRequest
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens
from omnistage.models.qwen3_omni.processor import encode_texts

ASR_TEXT = "<asr_text>"
# ISO 639 codes (as Whisper clients send them) of the 30 languages Qwen3-ASR names, to the names it writes.
LANGUAGES = {
    "zh": "Chinese",
    "en": "English",
    "yue": "Cantonese",
    "ar": "Arabic",
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "pt": "Portuguese",
    "id": "Indonesian",
    "it": "Italian",
    "ko": "Korean",
    "ru": "Russian",
    "th": "Thai",
    "vi": "Vietnamese",
    "ja": "Japanese",
    "tr": "Turkish",
    "hi": "Hindi",
    "ms": "Malay",
    "nl": "Dutch",
    "sv": "Swedish",
    "da": "Danish",
    "fi": "Finnish",
    "pl": "Polish",
    "cs": "Czech",
    "fil": "Filipino",
    "fa": "Persian",
    "el": "Greek",
    "hu": "Hungarian",
    "mk": "Macedonian",
    "ro": "Romanian",
}


def language_name(language: str, known: tuple[str, ...] = ()) -> str:
    """The name the model writes for `language` (a code such as "en" or a name such as "english").

    `known` is the checkpoint's own list (the released config's support_languages); without one, the 30.
    Anything else is an InvalidRequest naming the languages the model knows.
    """
    names = known or tuple(LANGUAGES.values())
    wanted = language.strip().lower()
    by_key = {name.lower(): name for name in names}
    by_key.update({code: name for code, name in LANGUAGES.items() if name in names})
    if wanted not in by_key:
        listed = ", ".join(f"{code} ({name})" for code, name in LANGUAGES.items() if name in names)
        extra = sorted(set(names) - set(LANGUAGES.values()))
        listed += "".join(f", {name}" for name in extra)
        raise InvalidRequest(f"language {language!r} is not one this model transcribes; it knows: {listed}")
    return by_key[wanted]


def prompt_text(context: str = "", language: str | None = None) -> str:
    """The prompt with one `<|audio_pad|>`; `language` is a name the model writes (see `language_name`)."""
    text = (
        f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n"
        "<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    return text + (f"language {language}{ASR_TEXT}" if language else "")


def prompt_ids(
    tokenizer: Tokenizer,
    cfg: Qwen3ASRConfig,
    mel_frames: int,
    context: str = "",
    language: str | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Token ids of the prompt for a clip of `mel_frames` frames, its placeholder expanded to one per audio token.

    With `max_model_len`, a prompt that leaves no room for one generated token is a RequestTooLarge."""
    if context and any(
        token.content in context for token in tokenizer.get_added_tokens_decoder().values() if token.special
    ):
        raise InvalidRequest("the context holds a control token (such as <|im_end|>); send plain text")
    count = audio_output_tokens(mel_frames, cfg.audio.n_window)
    (encoded,) = encode_texts(tokenizer, [prompt_text(context, language)], max_model_len, count - 1)
    ids = encoded.ids
    at = ids.index(cfg.audio_token_id)
    return ids[:at] + [cfg.audio_token_id] * count + ids[at + 1 :]
