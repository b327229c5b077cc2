"""Chat messages to token ids for Qwen3-Omni: the checkpoint's chat template and tokenizer, plus the media.

`process_chat` takes messages whose audio, image and video parts are already decoded (16 kHz mono float32,
PIL images, sampled frames), featurises them, expands every pad the template renders to as many placeholders
as the encoders will emit (prompt_media.py), and computes the prompt's M-RoPE positions (mrope.py).

The text of messages is tokenized as plain text: only the chat template adds control tokens, so a
`<|im_end|><|im_start|>system` typed in a message stays text. Given the model's context, text that cannot
fit it is refused by its size before it is tokenized.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer, decoders, normalizers

from omnistage.errors import CheckpointError, InvalidMedia, InvalidRequest, RequestTooLarge
from omnistage.models.chat_template import compile_template
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.multimodal import MultimodalInputs
from omnistage.models.qwen3_omni.audio_features import SAMPLE_RATE
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.image_processing import ImageProcessorConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.prompt_media import (
    MediaFormats,
    check_placeholders,
    expand_placeholders,
    featurise,
    media_parts,
)
from omnistage.models.qwen3_omni.transcription import (
    TRANSLATION_INSTRUCTION,
    max_transcription_tokens,
    transcription_messages,
)
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig

_ROLES = {"system", "user", "assistant", "tool"}
# Private-use characters around a per-render nonce: what the template renders where a message typed a
# control-token literal. Text cannot forge one without guessing the nonce.
_SENTINEL = "\ue000{nonce}{index}\ue001"


@dataclass
class ProcessedPrompt:
    """A rendered chat: `prompt` is the template's text (one placeholder per attachment), `token_ids` expanded."""

    prompt: str
    token_ids: list[int]
    mrope: PromptPositions | None  # None where every position is its own index (no images, no videos)
    mm: MultimodalInputs | None  # None without attachments
    # The reply's cap for a request that gives none, where the prompt implies one (a chat that is a transcription)
    max_tokens: int | None = None


class Processor:
    """Renders chat messages with the checkpoint's template and encodes them with its tokenizer."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        max_audios: int = 8,
        max_images: int = 8,
        max_videos: int = 4,
    ) -> None:
        directory = Path(checkpoint_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            template = (directory / "chat_template.jinja").read_text()
        except Exception as exc:
            raise CheckpointError(
                f"{directory}: cannot read the tokenizer or chat template ({exc})"
            ) from None
        self._template, reads = compile_template(template)
        self.renders_tools = "tools" in reads  # a template without tools would drop them unseen
        # The same tokenizer reading control-token literals as ordinary text, to spell typed ones with.
        self._plain = Tokenizer.from_str(self.tokenizer.to_str())
        self._plain.encode_special_tokens = True
        added = self.tokenizer.get_added_tokens_decoder()
        control = [t.content for t in added.values() if t.special]
        self._control_ids = frozenset(i for i, t in added.items() if t.special)
        longest_first = sorted(control, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, longest_first))) if control else None
        self.max_token_bytes = longest_token_bytes(self.tokenizer)
        self.max_audios, self.max_images, self.max_videos = max_audios, max_images, max_videos
        self._directory = directory
        self._thinker = None
        self._formats: MediaFormats | None = None

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The template's text for `messages`; `template_kwargs` are more variables for the template (vLLM's
        `chat_template_kwargs`, such as `enable_thinking`), passed on as transformers passes them: a key the
        template does not read changes nothing, and none stands in for the messages themselves. `tools` are
        OpenAI's tool definitions (`{"type": "function", "function": {...}}`), which a released Qwen template
        writes into the system turn."""
        if not messages:
            raise InvalidRequest("messages: at least one message is required")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise InvalidRequest(f"messages[{i}].role: must be one of {sorted(_ROLES)}")
            content = message.get("content")
            if content is None and message.get("tool_calls"):
                continue
            if content is None:
                raise InvalidRequest(f"messages[{i}].content: missing")
            if not isinstance(content, str | list):
                raise InvalidRequest(f"messages[{i}].content: must be a string or a list of content parts")
        variables = {**(template_kwargs or {}), "messages": messages, "tools": tools}
        return self._template.render(variables, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """Token ids of a raw prompt, in which control-token literals are control tokens (the model's own
        notation, as a completions prompt is written). With `max_model_len`, a prompt that cannot leave room
        for one generated token is a RequestTooLarge, refused by its size before it is tokenized."""
        check_text_size(text, self.tokenizer, self.max_token_bytes, max_model_len)
        return self._encode([text], [], max_model_len)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered chat and its token ids, the messages' text tokenized as plain text.

        A control-token literal typed in a message (or in a string of `template_kwargs` or `tools`) is replaced by a sentinel before rendering and spelled
        as ordinary text where the sentinel lands; the rest is encoded piecewise as usual. Text without
        such literals (nearly all) is encoded as the rendered whole, exactly as transformers encodes it.

        An assistant message may carry the ids the model sampled for its text (`token_ids`, as a realtime
        session keeps its replies): where they decode to its content, they stand in the prompt for that text
        as they were sampled. Encoding the text again can split it otherwise, and each such reply would then
        end the prefix cache's hits at its turn.
        """
        typed: list[tuple[str, list[int] | None]] = []  # (its text, its ids where given) per sentinel
        nonce = secrets.token_hex(8)

        def hide(match: re.Match) -> str:
            typed.append((match.group(), None))
            return _SENTINEL.format(nonce=nonce, index=len(typed) - 1)

        def sampled(message: dict) -> dict:
            ids, text = list(message.get("token_ids") or ()), message.get("content")
            while ids and ids[-1] in self._control_ids:  # the reply's end token: the template writes its own
                ids.pop()
            if not ids or message.get("role") != "assistant" or not isinstance(text, str):
                return message
            if self.decode(ids, skip_special_tokens=False) != text:
                return message
            typed.append((text, ids))
            return {**message, "content": _SENTINEL.format(nonce=nonce, index=len(typed) - 1)}

        messages = [sampled(m) for m in messages]
        control = self._control
        if control is not None:
            messages = [_map_text(m, lambda text: control.sub(hide, text)) for m in messages]
            template_kwargs = _map_strings(template_kwargs or {}, lambda text: control.sub(hide, text))
            tools = _map_strings(tools, lambda text: control.sub(hide, text))
        rendered = self.render_chat(messages, add_generation_prompt, template_kwargs, tools)
        if not typed:
            return rendered, self.encode(rendered, max_model_len)
        sentinel = re.escape(_SENTINEL.format(nonce=nonce, index="@")).replace("@", "(\\d+)")
        pieces = re.split(sentinel, rendered)  # text, index, text, index, ..., text
        texts, literals = pieces[0::2], [typed[int(i)] for i in pieces[1::2]]
        prompt = "".join(t + lit for t, (lit, _) in zip(texts, [*literals, ("", None)]))
        check_text_size(prompt, self.tokenizer, self.max_token_bytes, max_model_len)
        return prompt, self._encode(texts, literals, max_model_len)

    def transcription(
        self, audio: np.ndarray, language: str | None, prompt: str | None, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """The Thinker's transcription prompt for `audio` (16 kHz mono), its reply capped by the clip's length:
        see transcription.py."""
        processed = self.process_chat(transcription_messages(audio, language, prompt), True, max_model_len)
        return replace(processed, max_tokens=max_transcription_tokens(len(audio) / SAMPLE_RATE))

    def translation(
        self, audio: np.ndarray, prompt: str | None, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """The Thinker's prompt of translating the speech in `audio` into English text, capped as a
        transcription of the clip is."""
        messages = transcription_messages(audio, None, prompt, TRANSLATION_INSTRUCTION)
        processed = self.process_chat(messages, True, max_model_len)
        return replace(processed, max_tokens=max_transcription_tokens(len(audio) / SAMPLE_RATE))

    def transcript(self, text: str) -> tuple[str | None, str]:
        """The Thinker answers with the transcript alone: no language of its own."""
        return None, text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def process_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        use_audio_in_video: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> ProcessedPrompt:
        """Render, featurise the decoded media parts, expand their placeholders, tokenize, place (M-RoPE).

        `max_model_len` refuses text that cannot fit the context before it is tokenized, as `encode` does.
        `use_audio_in_video` interleaves every video's sound track with its frames (each must carry one).
        """
        parts = media_parts(messages)
        for kind, limit in (
            ("audio", self.max_audios),
            ("image", self.max_images),
            ("video", self.max_videos),
        ):
            if len(parts.of(kind)) > limit:
                raise InvalidMedia(
                    f"too many {kind} attachments: {len(parts.of(kind))} (the limit is {limit})"
                )
        prompt, ids = self.encode_chat(messages, add_generation_prompt, max_model_len, template_kwargs, tools)
        cfg = self._config()
        check_placeholders(ids, parts, cfg)
        if not parts.items:
            return ProcessedPrompt(prompt, ids, None, None)
        mm = featurise(parts, self.formats(), use_audio_in_video)
        expanded = expand_placeholders(ids, mm, cfg)
        layout = MediaLayout.of(mm, cfg)
        return ProcessedPrompt(
            prompt, expanded, layout.positions(expanded, cfg) if layout.spatial else None, mm
        )

    def _encode(
        self, texts: list[str], literals: list[tuple[str, list[int] | None]], max_model_len: int | None
    ) -> list[int]:
        """texts[0] literals[0] texts[1] ... texts[-1] as one list of ids: a literal as its given ids, or its text
        spelled as plain text."""
        plain = [text for text, given in literals if given is None]
        spelled = (
            iter(e.ids for e in self._plain.encode_batch(plain, add_special_tokens=False))
            if plain
            else iter(())
        )
        literal_ids = [given if given is not None else next(spelled) for _, given in literals]
        encoded = encode_texts(self.tokenizer, texts, max_model_len, sum(map(len, literal_ids)))
        ids: list[int] = []
        for i, encoding in enumerate(encoded):
            if i:
                ids += literal_ids[i - 1]
            ids += encoding.ids
        return ids

    def _config(self):
        if self._thinker is None:
            self._thinker = Qwen3OmniConfig.from_dir(self._directory).thinker
        return self._thinker

    def formats(self) -> MediaFormats:
        """How this checkpoint's media are featurised: its image and video preprocessor settings."""
        if self._formats is None:
            found = (self._directory / "preprocessor_config.json").exists()
            images = ImageProcessorConfig.from_dir(self._directory) if found else ImageProcessorConfig()
            videos = VideoProcessorConfig.from_dir(self._directory)
            merge = self._config().vision.spatial_merge_size
            for kind, given in (
                ("preprocessor", images.merge_size),
                ("video preprocessor", videos.merge_size),
            ):
                if given != merge:
                    raise CheckpointError(
                        f"{self._directory}: {kind} merge_size {given} differs from the vision encoder's "
                        f"spatial_merge_size {merge}"
                    )
            self._formats = MediaFormats(self._config(), images, videos)
        return self._formats


def check_text_size(text: str, tokenizer: Tokenizer, max_token_bytes: int, max_model_len: int | None) -> None:
    """Refuse text longer in bytes than `max_model_len` of the vocabulary's longest tokens could hold, before it
    is tokenized: every family's processor checks its prompt's text here."""
    if max_model_len is None:
        return
    limit = max_model_len * max_token_bytes
    size = len(text.encode())
    if size > limit:
        size = _normalized_size(text, tokenizer.normalizer, size)
    if size > limit:
        raise RequestTooLarge(
            f"the prompt is {size:,} bytes of text; the model's context of {max_model_len:,} tokens holds at "
            f"most {limit:,} bytes ({max_token_bytes} per token at most)"
        )


def encode_texts(
    tokenizer: Tokenizer, texts: list[str], max_model_len: int | None, others: int = 0
) -> list[Encoding]:
    """The encodings of `texts` (no special tokens added), for every family's processor. With `max_model_len`, a
    prompt of them and `others` tokens more that leaves no room for one generated token is a RequestTooLarge,
    refused before its ids become Python lists.

    encode_batch, not encode: it lets go of the GIL while it works, where encode holds it (the event loop
    then stops for as long as a long prompt takes; tests/server/test_prompt_size.py).
    """
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    count = sum(map(len, encoded)) + others
    if max_model_len is not None and count >= max_model_len:
        raise RequestTooLarge(
            f"the prompt has {count:,} tokens; the model's context is {max_model_len:,} tokens"
        )
    return encoded


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token stands for, over the vocabulary and the added tokens.

    A byte-level BPE spells each byte as one character of its vocabulary; any other model's token strings
    are measured in UTF-8, which over-counts (a "▁" or "##" marker) but never under-counts.
    """
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    added = [len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values()]
    return max([longest, *added])


_UNICODE_FORMS = (normalizers.NFC, normalizers.NFD, normalizers.NFKC, normalizers.NFKD)


def _normalized_size(text: str, normalizer: normalizers.Normalizer | None, size: int) -> int:
    """The UTF-8 size of `text` as the tokenizer's model sees it (`size`: as given).

    Normalizing can shrink text (NFC composes three Hangul jamo into one syllable), so a text over the
    bound by its own size may fit once normalized; only such texts pay for normalizing them. ASCII is its
    own normal form under every Unicode form.
    """
    if normalizer is None or (text.isascii() and isinstance(normalizer, _UNICODE_FORMS)):
        return size
    return len(normalizer.normalize_str(text).encode())


def _map_text(message: dict, change: Callable[[str], str]) -> dict:
    """A copy of `message` with `change` applied to its text content (a string, or its text parts) and to its
    tool calls."""
    if isinstance(message, dict) and message.get("tool_calls"):
        message = {**message, "tool_calls": _map_strings(message["tool_calls"], change)}
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return {**message, "content": change(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": change(p["text"])}
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` (a template variable: JSON data) with `change` applied to every string in it."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    return value
