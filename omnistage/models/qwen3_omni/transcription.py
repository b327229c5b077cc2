"""The transcription and translation prompts of the Omni Thinker: one audio clip, an instruction, the language if
known."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

INSTRUCTION = "Transcribe the audio into text."
# OpenAI's translations endpoint: speech in any language to English text, the Thinker told so in its instruction.
TRANSLATION_INSTRUCTION = "Translate the speech in the audio into English text."
# A transcript's length in tokens: fast speech is ~4 words/s, ~6 tokens/s of English with Qwen's vocabulary
# and about as many for Chinese; the cap leaves more than twice that, and room for a short clip's preamble.
TOKENS_PER_SECOND = 16
MIN_TOKENS_CAP = 32

# ISO 639-1 codes (as Whisper clients send them) of the languages Qwen3-Omni transcribes, to their names.
LANGUAGES = {
    "en": "English",
    "zh": "Chinese",
    "yue": "Cantonese",
    "ja": "Japanese",
    "ko": "Korean",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "ru": "Russian",
    "ar": "Arabic",
    "id": "Indonesian",
    "th": "Thai",
    "vi": "Vietnamese",
    "tr": "Turkish",
    "hi": "Hindi",
    "ms": "Malay",
    "nl": "Dutch",
}


def language_name(language: str | None) -> str | None:
    """'en' -> 'English'; a name or an unknown code is taken as given."""
    if not language:
        return None
    return LANGUAGES.get(language.strip().lower(), language.strip())


def transcription_messages(
    audio: np.ndarray, language: str | None, prompt: str | None, instruction: str = INSTRUCTION
) -> list[dict[str, Any]]:
    """The chat the Thinker transcribes (or, told so by `instruction`, translates) from: decoded audio (16 kHz
    mono) and the instruction."""
    name = language_name(language)
    if name:
        instruction += f" The language is {name}."
    messages: list[dict[str, Any]] = []
    if prompt:
        messages.append({"role": "system", "content": prompt})
    user = [{"type": "audio", "audio": audio}, {"type": "text", "text": instruction}]
    messages.append({"role": "user", "content": user})
    return messages


def max_transcription_tokens(seconds: float) -> int:
    """The most tokens a transcript of `seconds` of audio is given, so that no transcription runs on to the
    context limit (a model that never ends its answer stops here)."""
    return MIN_TOKENS_CAP + TOKENS_PER_SECOND * math.ceil(seconds)
