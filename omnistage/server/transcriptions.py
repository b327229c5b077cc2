"""`/v1/audio/transcriptions` as the Omni Thinker does it: one audio clip and a transcription instruction.

OpenAI's multipart form comes in; the clip goes into a user message beside "Transcribe the audio into
text." (plus the language when the client names it), the client's `prompt` goes in as a system message
of context, and the answer goes out as json, text or verbose_json, or as `transcript.text.*` events when
`stream` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import PlainTextResponse, Response

from omnistage.errors import InvalidRequest
from omnistage.server.formats import sse
from omnistage.server.responses import Usage

RESPONSE_FORMATS = ("json", "text", "verbose_json")
Transcript = Callable[[str], tuple[str | None, str]]


def check_response_format(response_format: str) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format {response_format!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}"
        )


class TranscriptionFormat:
    """The `Format` of the transcription endpoint: OpenAI's transcription bodies and stream events.

    A stream is `transcript.text.delta` events and one `transcript.text.done` carrying the whole text and
    the token usage, as OpenAI's streamed transcriptions end.
    """

    include_usage = True  # the usage rides on the done event

    def __init__(
        self,
        request_id: str,
        response_format: str,
        language: str | None,
        duration: float,
        transcript: Transcript = lambda text: (None, text),
    ) -> None:
        """`language`: the name of the language the client gave, if any; `transcript` reads the model's reply:
        the language it names, if any, and the text (Qwen3-ASR writes `language English<asr_text>...`; the
        Omni Thinker the text alone)."""
        self.id = request_id
        self.response_format = response_format
        self.language = (language or "unknown").lower()
        self.duration = duration
        self.transcript = transcript
        self._raw = ""
        self._text = ""

    def opening(self) -> list[str]:
        return []

    def delta(self, text: str, finish_reason: str | None) -> list[str]:
        """The transcript's new text: the reply read so far, less what went out already (a language header is
        held back until the transcript after it begins)."""
        self._raw += text
        _, transcript = self.transcript(self._raw)
        if not transcript.startswith(self._text) or len(transcript) == len(self._text):
            return []
        new, self._text = transcript[len(self._text) :], transcript
        return [sse({"type": "transcript.text.delta", "delta": new})]

    def closing(self, finish_reason: str) -> list[str]:
        return []

    def usage_chunk(self, usage: Usage) -> str:
        tokens = {
            "type": "tokens",
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        return sse({"type": "transcript.text.done", "text": self.transcript(self._raw)[1], "usage": tokens})

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any] | Response:
        language, text = self.transcript(text)
        if self.response_format == "text":
            return PlainTextResponse(text)
        if self.response_format == "verbose_json":
            return {
                "task": "transcribe",
                "language": (language or self.language).lower(),
                "duration": round(self.duration, 3),
                "text": text,
                "segments": [],
            }
        return {"text": text}
