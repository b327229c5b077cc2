"""The reply of Qwen3-ASR read back: `language {Name}<asr_text>{transcript}`.

"language None<asr_text>" is the model's word for audio without speech. Before splitting, runs that repeat
more than 20 times are cut to one (a character, or a pattern of up to 20 characters), as the released
pipeline does: a greedy decoder that loops would otherwise return the loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from omnistage.models.qwen3_asr.prompt import ASR_TEXT

REPEAT_THRESHOLD = 20
MAX_PATTERN = 20


@dataclass(frozen=True)
class Transcription:
    language: str | None
    text: str


def collapse_repeats(text: str, threshold: int = REPEAT_THRESHOLD) -> str:
    """One copy of any character run longer than `threshold`, then one copy of the first pattern (1..20 chars)
    that starts `threshold` back-to-back copies of itself, and so on in what follows it."""
    runs = (list(run) for _, run in itertools.groupby(text))
    text = "".join(run[0] if len(run) > threshold else "".join(run) for run in runs)
    return _collapse_patterns(text, threshold)


def _collapse_patterns(text: str, threshold: int) -> str:
    n = len(text)
    # the released pipeline looks for patterns only where twice the threshold of characters remain
    for start in range(max(n - 2 * threshold + 1, 0)):
        for size in range(1, MAX_PATTERN + 1):
            if start + size * threshold > n:
                break
            pattern = text[start : start + size]
            if text.startswith(pattern * threshold, start):
                end = start + size * threshold
                while text.startswith(pattern, end):
                    end += size
                return text[:start] + pattern + _collapse_patterns(text[end:], threshold)
    return text


def parse_transcription(raw: str) -> Transcription:
    """The language (None when the model wrote none or "None") and the transcript of a decoded reply."""
    text = raw.strip() if raw else ""
    if not text:
        return Transcription(None, "")
    if "assistant\n" in text:  # a decoded prompt and reply together: keep the reply
        text = text.split("assistant\n", 1)[1]
    text = collapse_repeats(text)
    if ASR_TEXT not in text:
        return Transcription(None, text.strip())
    head, transcript = text.split(ASR_TEXT, 1)
    head = head.strip()
    if head.lower() == "language none":
        return Transcription(None, transcript.strip())
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    language = first[len("language ") :].strip() if first.lower().startswith("language ") else first
    return Transcription(language or None, transcript.strip())
