"""Log-probabilities as OpenAI spells them: each token's text and UTF-8 bytes (`TokenTexts`), chat's `content`
entries, text completions' legacy lists (`CompletionLogprobsWriter`) and transcriptions' entries.

A token's text is its bytes as UTF-8 (a byte-level token holding part of a character reads as U+FFFD), and its
bytes are exact, so that a client joining the bytes of the tokens gets the reply's bytes. Every generated
token has an entry, the one that ended the reply included (its text is the end token's, e.g. `<|im_end|>`),
so there are as many as the usage's completion_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders

from omnistage.outputs import TokenLogprobs
from omnistage.pipeline.base import Frontend
from omnistage.server.responses import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf: a logprob below this is sent as this (vLLM's floor).
LOGPROB_FLOOR = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet inverted: the byte each character of a token stands for. Printable Latin-1
    bytes stand for themselves; the others (controls, space, soft hyphen) are the characters from U+0100 on,
    in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Each token id's bytes and text, as logprobs spell them; computed once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._alphabet = _byte_level_alphabet() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._read(token_id)
        return found

    def text(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _read(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # a row of the model's vocabulary beyond the tokenizer's
            return b""
        if self._alphabet is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()


class LazyTokenTexts:
    """An endpoint's TokenTexts of its frontend's tokenizer, made when a request first asks for logprobs."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._texts: TokenTexts | None = None

    def get(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.frontend.processor.tokenizer)
        return self._texts


def floored(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, from logits gone bad) become the floor."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def top_logprob(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    """One token's entry: its text, logprob and bytes (transcriptions' entries, chat's top_logprobs)."""
    return TopLogprob(
        token=texts.text(token_id), logprob=floored(logprob), bytes=list(texts.bytes_of(token_id))
    )


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprobs]) -> ChatChoiceLogprobs:
    """Chat's `logprobs` of a choice, or of a stream chunk's tokens."""
    content = [
        ChatTokenLogprob(
            **top_logprob(texts, lp.token_id, lp.logprob).model_dump(),
            top_logprobs=[top_logprob(texts, t, v) for t, v in lp.top],
        )
        for lp in logprobs
    ]
    return ChatChoiceLogprobs(content=content)


class CompletionLogprobsWriter:
    """Text completions' legacy `logprobs`, chunk after chunk of one reply: each token's `text_offset` counts
    the characters of the tokens before it, from `offset` (the echoed prompt's length)."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts, self.offset = texts, offset

    def write(self, logprobs: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        """The entries of the next tokens. As OpenAI's, each `top_logprobs` maps the top tokens' texts and the
        sampled one's to their logprobs (up to logprobs + 1 of them)."""
        written = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in logprobs:
            token = self.texts.text(lp.token_id)
            top = {self.texts.text(t): floored(v) for t, v in lp.top}
            top.setdefault(token, floored(lp.logprob))
            written.tokens.append(token)
            written.token_logprobs.append(floored(lp.logprob))
            written.top_logprobs.append(top)
            written.text_offset.append(self.offset)
            self.offset += len(token)
        return written
