"""Token ids to streamed text: UTF-8-safe deltas, cut at the first stop string.

A byte-level tokenizer's decode of ids is its tokens' bytes joined, read as UTF-8. So a token whose bytes are
whole characters, after tokens that left no character unfinished, adds its own decode: looked up once per
token and tokenizer (`_pieces`), where decoding the window around it costs two decode calls a token (~1.8
µs a token on this project's CPU machine, a step's 128 tokens ~0.2 ms of the engine's host work). Any
other token goes through the window as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders

REPLACEMENT_CHAR = "\ufffd"
# per byte-level tokenizer: per (token id, skip_special_tokens), its decode where that is whole characters,
# else None
_PIECES: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, bool], str | None]] = (
    weakref.WeakKeyDictionary()
)


def _pieces(tokenizer: Tokenizer) -> dict[tuple[int, bool], str | None] | None:
    """The tokenizer's table of single tokens' decodes; None where its decoder is not byte-level (a
    SentencePiece decoder, say, strips a leading space only at the text's start)."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    pieces = _PIECES.get(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = {}
    return pieces


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive and reports text deltas.

    Invariant: the deltas from `add` plus `flush()` concatenate to `text`, which equals
    `tokenizer.decode(token_ids)` cut at the first stop string to complete.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text, once one has
        self._text = ""
        self._emitted = 0  # characters of _text already handed out as deltas
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # Tokens [prefix, read) were decoded last step and give the context that makes
        # decode(token_ids[prefix:]) start on a character boundary; [read, end) are not yet in _text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._pieces = _pieces(tokenizer)

    @property
    def text(self) -> str:
        """All decoded text so far, including characters still held back from the deltas."""
        return self._text

    def add(self, token_id: int) -> str:
        """Take the next output token and return the text it releases (often empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if self._pieces is not None and self._read_offset == len(self.token_ids) - 1:
            piece = self._piece(token_id)
            if piece is not None:  # whole characters after whole characters: the token's own decode
                self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
                return self._extend(piece, final=False) if piece else ""
        prefix_text, new_text = self._decode_window()
        # A trailing U+FFFD is a multi-byte character still missing bytes: wait for the next token.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._extend(new_text[len(prefix_text) :], final=False)

    def flush(self) -> str:
        """Release everything held back, at the end of generation; empty once a stop string has hit."""
        if self.stopped:
            return ""
        tail = ""
        if self._read_offset < len(self.token_ids):
            prefix_text, new_text = self._decode_window()
            tail = new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._extend(tail, final=True)

    def _piece(self, token_id: int) -> str | None:
        """The token's decode alone where that is whole characters, else None (looked up once)."""
        assert self._pieces is not None
        key = (token_id, self.skip_special_tokens)
        if key not in self._pieces:
            text = self.tokenizer.decode([token_id], self.skip_special_tokens)
            self._pieces[key] = None if REPLACEMENT_CHAR in text else text
        return self._pieces[key]

    def _decode_window(self) -> tuple[str, str]:
        window = self.token_ids[self._prefix_offset :]
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(window[: self._read_offset - self._prefix_offset], skip)
        return prefix_text, self.tokenizer.decode(window, skip)

    def _extend(self, new_text: str, final: bool) -> str:
        old_length = len(self._text)
        self._text += new_text
        if not self.stop:
            return self._release(len(self._text))
        hit = self._find_stop(old_length)
        if hit is not None:
            start, stop = hit
            self._text = self._text[: start + len(stop) if self.include_stop_str_in_output else start]
            self.stopped, self.stop_str = True, stop
            return self._release(len(self._text))
        return self._release(len(self._text) if final else len(self._text) - self._stop_prefix_length())

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self, old_length: int) -> tuple[int, str] | None:
        """The earliest stop string that completes in the text added since `old_length`."""
        if not self.stop:
            return None
        # A match lying wholly inside the old text would have been found on an earlier step.
        search_from = max(0, old_length - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = self._text.find(stop, search_from)
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for length in range(min(self._max_stop - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
