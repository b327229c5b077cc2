"""`/v1/audio/transcriptions` as the Omni Thinker does it: one audio clip and a transcription instruction.

OpenAI's multipart form comes in; the clip goes into a user message beside "Transcribe the audio into
text." (plus the language when the client names it), the client's `prompt` goes in as a system message
of context, and the answer goes out as json, text or verbose_json, or as `transcript.text.*` events when
`stream` is set.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.responses import PlainTextResponse, Response

from omnistage.errors import InvalidRequest
from omnistage.models.qwen3_omni.audio_features import SAMPLE_RATE
from omnistage.server.formats import sse
from omnistage.server.protocol import Usage

RESPONSE_FORMATS = ("json", "text", "verbose_json")
INSTRUCTION = "Transcribe the audio into text."

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


def check_response_format(response_format: str) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format {response_format!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}"
        )


def language_name(language: str | None) -> str | None:
    """'en' -> 'English'; a name or an unknown code is taken as given."""
    if not language:
        return None
    return LANGUAGES.get(language.strip().lower(), language.strip())


def transcription_messages(
    audio: np.ndarray, language: str | None, prompt: str | None
) -> list[dict[str, Any]]:
    """The chat the Thinker transcribes from: decoded audio (16 kHz mono) and the instruction."""
    instruction = INSTRUCTION
    name = language_name(language)
    if name:
        instruction += f" The language is {name}."
    messages: list[dict[str, Any]] = []
    if prompt:
        messages.append({"role": "system", "content": prompt})
    user = [{"type": "audio", "audio": audio}, {"type": "text", "text": instruction}]
    messages.append({"role": "user", "content": user})
    return messages


class TranscriptionFormat:
    """The `Format` of the transcription endpoint: OpenAI's transcription bodies and stream events.

    A stream is `transcript.text.delta` events and one `transcript.text.done` carrying the whole text and
    the token usage, as OpenAI's streamed transcriptions end.
    """

    include_usage = True  # the usage rides on the done event

    def __init__(self, request_id: str, response_format: str, language: str | None, duration: float) -> None:
        self.id = request_id
        self.response_format = response_format
        self.language = (language_name(language) or "unknown").lower()
        self.duration = duration
        self._text = ""

    @classmethod
    def for_audio(
        cls, request_id: str, response_format: str, language: str | None, audio: np.ndarray
    ) -> TranscriptionFormat:
        return cls(request_id, response_format, language, len(audio) / SAMPLE_RATE)

    def opening(self) -> list[str]:
        return []

    def delta(self, text: str, finish_reason: str | None) -> list[str]:
        if not text:
            return []
        self._text += text
        return [sse({"type": "transcript.text.delta", "delta": text})]

    def closing(self, finish_reason: str) -> list[str]:
        return []

    def usage_chunk(self, usage: Usage) -> str:
        tokens = {
            "type": "tokens",
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        return sse({"type": "transcript.text.done", "text": self._text, "usage": tokens})

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any] | Response:
        if self.response_format == "text":
            return PlainTextResponse(text)
        if self.response_format == "verbose_json":
            return {
                "task": "transcribe",
                "language": self.language,
                "duration": round(self.duration, 3),
                "text": text,
                "segments": [],
            }
        return {"text": text}
