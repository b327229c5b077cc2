"""Transcripts as subtitles (`response_format` `srt` and `vtt`): the text in cues of a sentence or two lines.

The models give no timestamps, so a cue's time is estimated: the clip's duration is shared among the cues in
proportion to their characters, which holds well enough for even speech and drifts with pauses. Word timing
is for a later aligner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Two subtitle lines of 42 characters, the common broadcast limit.
MAX_CUE_CHARS = 84
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+|(?<=[。！？])")


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str


def cues(text: str, duration: float) -> list[Cue]:
    """`text` split at sentence ends, and at word (else character) boundaries within `MAX_CUE_CHARS`, each
    piece timed by its share of the characters over `duration` seconds."""
    pieces = [piece for sentence in _SENTENCE_END.split(text.strip()) for piece in _wrap(sentence.strip())]
    total = sum(len(piece) for piece in pieces)
    timed: list[Cue] = []
    done = 0
    for piece in pieces:
        start = duration * done / total
        done += len(piece)
        timed.append(Cue(start, duration * done / total, piece))
    return timed


def _wrap(sentence: str) -> list[str]:
    """`sentence` in pieces of at most MAX_CUE_CHARS, broken between words where it has spaces (any run of
    whitespace, a line break too, is one space: a cue is one line of text)."""
    pieces: list[str] = []
    line = ""
    spaced = len(words := sentence.split()) > 1
    for word in words if spaced else list(sentence):
        joined = f"{line} {word}" if line and spaced else line + word
        if line and len(joined) > MAX_CUE_CHARS:
            pieces.append(line)
            joined = word
        line = joined
        while len(line) > MAX_CUE_CHARS:  # one word longer than a cue
            pieces.append(line[:MAX_CUE_CHARS])
            line = line[MAX_CUE_CHARS:]
    return [*pieces, line] if line else pieces


def srt(text: str, duration: float) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, a blank line after each."""
    return "".join(
        f"{i}\n{_clock(c.start, ',')} --> {_clock(c.end, ',')}\n{c.text}\n\n"
        for i, c in enumerate(cues(text, duration), 1)
    )


def vtt(text: str, duration: float) -> str:
    """WebVTT: the header, then cues `HH:MM:SS.mmm --> HH:MM:SS.mmm`."""
    body = "".join(
        f"{_clock(c.start, '.')} --> {_clock(c.end, '.')}\n{c.text}\n\n" for c in cues(text, duration)
    )
    return "WEBVTT\n\n" + body


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"
