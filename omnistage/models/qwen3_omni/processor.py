"""Chat messages to token ids for Qwen3-Omni: the checkpoint's chat template and tokenizer, plus the media.

`process_chat` takes messages whose audio and image parts are already decoded (16 kHz mono float32 and
PIL images), computes each clip's log-mel and each image's patches, expands every `<|audio_pad|>` and
`<|image_pad|>` the template renders to as many placeholders as the encoders will emit, and computes the
prompt's M-RoPE positions.

The text of messages is tokenized as plain text: only the chat template adds control tokens, so a
`<|im_end|><|im_start|>system` typed in a message stays text. Given the model's context, text that cannot
fit it is refused by its size before it is tokenized.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image
from tokenizers import Encoding, Tokenizer, decoders, normalizers

from omnistage.errors import CheckpointError, InvalidMedia, InvalidRequest, RequestTooLarge
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.multimodal import MultimodalInputs
from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens
from omnistage.models.qwen3_omni.audio_features import SAMPLE_RATE, log_mel
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.image_processing import (
    MAX_DECODED_PIXELS,
    ImageProcessorConfig,
    image_tokens,
    preprocess_images,
)
from omnistage.models.qwen3_omni.mrope import rope_positions
from omnistage.models.qwen3_omni.transcription import max_transcription_tokens, transcription_messages

_ROLES = {"system", "user", "assistant"}
AUDIO_PARTS = ("audio", "input_audio", "audio_url")
IMAGE_PARTS = ("image", "image_url")
VIDEO_PARTS = ("video", "video_url")
# Private-use characters around a per-render nonce: what the template renders where a message typed a
# control-token literal. Text cannot forge one without guessing the nonce.
_SENTINEL = "\ue000{nonce}{index}\ue001"


@dataclass
class ProcessedPrompt:
    """A rendered chat: `prompt` is the template's text (one placeholder per attachment), `token_ids` expanded."""

    prompt: str
    token_ids: list[int]
    mrope: PromptPositions | None  # None where every position is its own index (no images)
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
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: where the mel features are computed and left, the engine's (default: the CPU)."""
        directory = Path(checkpoint_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            template = (directory / "chat_template.jinja").read_text()
        except Exception as exc:
            raise CheckpointError(
                f"{directory}: cannot read the tokenizer or chat template ({exc})"
            ) from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)
        # The same tokenizer reading control-token literals as ordinary text, to spell typed ones with.
        self._plain = Tokenizer.from_str(self.tokenizer.to_str())
        self._plain.encode_special_tokens = True
        control = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        longest_first = sorted(control, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, longest_first))) if control else None
        self.max_token_bytes = longest_token_bytes(self.tokenizer)
        self.max_audios, self.max_images = max_audios, max_images
        self.device = torch.device("cpu" if device is None else device)
        self._directory = directory
        self._thinker = None
        self._image_cfg: ImageProcessorConfig | None = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidRequest("messages: at least one message is required")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise InvalidRequest(f"messages[{i}].role: must be one of {sorted(_ROLES)}")
            content = message.get("content")
            if content is None:
                raise InvalidRequest(f"messages[{i}].content: missing")
            if not isinstance(content, str | list):
                raise InvalidRequest(f"messages[{i}].content: must be a string or a list of content parts")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """Token ids of a raw prompt, in which control-token literals are control tokens (the model's own
        notation, as a completions prompt is written). With `max_model_len`, a prompt that cannot leave room
        for one generated token is a RequestTooLarge, refused by its size before it is tokenized."""
        check_text_size(text, self.tokenizer, self.max_token_bytes, max_model_len)
        return self._encode([text], [], max_model_len)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, max_model_len: int | None = None
    ) -> tuple[str, list[int]]:
        """The rendered chat and its token ids, the messages' text tokenized as plain text.

        A control-token literal typed in a message is replaced by a sentinel before rendering and spelled
        as ordinary text where the sentinel lands; the rest is encoded piecewise as usual. Text without
        such literals (nearly all) is encoded as the rendered whole, exactly as transformers encodes it.
        """
        typed: list[str] = []
        nonce = secrets.token_hex(8)

        def hide(match: re.Match) -> str:
            typed.append(match.group())
            return _SENTINEL.format(nonce=nonce, index=len(typed) - 1)

        control = self._control
        if control is not None:
            messages = [_map_text(m, lambda text: control.sub(hide, text)) for m in messages]
        rendered = self.render_chat(messages, add_generation_prompt)
        if not typed:
            return rendered, self.encode(rendered, max_model_len)
        sentinel = re.escape(_SENTINEL.format(nonce=nonce, index="@")).replace("@", "(\\d+)")
        pieces = re.split(sentinel, rendered)  # text, index, text, index, ..., text
        texts, literals = pieces[0::2], [typed[int(i)] for i in pieces[1::2]]
        prompt = "".join(t + lit for t, lit in zip(texts, [*literals, ""]))
        check_text_size(prompt, self.tokenizer, self.max_token_bytes, max_model_len)
        return prompt, self._encode(texts, literals, max_model_len)

    def transcription(
        self, audio: np.ndarray, language: str | None, prompt: str | None, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """The Thinker's transcription prompt for `audio` (16 kHz mono), its reply capped by the clip's length:
        see transcription.py."""
        processed = self.process_chat(transcription_messages(audio, language, prompt), True, max_model_len)
        return replace(processed, max_tokens=max_transcription_tokens(len(audio) / SAMPLE_RATE))

    def transcript(self, text: str) -> tuple[str | None, str]:
        """The Thinker answers with the transcript alone: no language of its own."""
        return None, text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def process_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """Render, featurise the decoded media parts, expand their placeholders, tokenize, place (M-RoPE).

        `max_model_len` refuses text that cannot fit the context before it is tokenized, as `encode` does.
        """
        audios, images = _media_parts(messages)
        for kind, found, limit in (("audio", audios, self.max_audios), ("image", images, self.max_images)):
            if len(found) > limit:
                raise InvalidMedia(f"too many {kind} attachments: {len(found)} (the limit is {limit})")
        prompt, ids = self.encode_chat(messages, add_generation_prompt, max_model_len)
        cfg = self._config()
        for token, kind, found in (
            (cfg.audio_token_id, "audio", audios),
            (cfg.image_token_id, "image", images),
        ):
            rendered = ids.count(token)
            if rendered != len(found):  # typed placeholders are text, so only the template can cause this
                raise InvalidRequest(
                    f"the chat template rendered {rendered} {kind} placeholders for {len(found)} {kind} attachments"
                )
        if not audios and not images:
            return ProcessedPrompt(prompt, ids, None, None)
        mm = self._featurise(audios, images)
        counts = {
            cfg.audio_token_id: iter(mm.num_audio_tokens),
            cfg.image_token_id: iter(mm.num_image_tokens),
        }
        expanded: list[int] = []
        for token in ids:
            expanded += [token] * next(counts[token]) if token in counts else [token]
        grids = [] if mm.image_grid_thw is None else [tuple(g) for g in mm.image_grid_thw.tolist()]
        mrope = rope_positions(expanded, grids, mm.num_audio_tokens, cfg) if images else None
        return ProcessedPrompt(prompt, expanded, mrope, mm)

    def _encode(self, texts: list[str], literals: list[str], max_model_len: int | None) -> list[int]:
        """texts[0] literals[0] texts[1] ... texts[-1] as one list of ids, the literals spelled as plain text."""
        spelled = self._plain.encode_batch(literals, add_special_tokens=False) if literals else []
        encoded = encode_texts(self.tokenizer, texts, max_model_len, sum(map(len, spelled)))
        ids: list[int] = []
        for i, encoding in enumerate(encoded):
            if i:
                ids += spelled[i - 1].ids
            ids += encoding.ids
        return ids

    def _featurise(
        self, audios: list[tuple[str, object]], images: list[tuple[str, object]]
    ) -> MultimodalInputs:
        cfg = self._config()
        features, patches, grids = [], [], []
        for where, audio in audios:
            with _part(where):
                features.append(log_mel(_waveform(audio), self.device))
        for where, image in images:
            with _part(where):
                pixels, grid = preprocess_images([_image(image)], self._image_config())
            patches.append(pixels)
            grids.append(grid)
        grid_thw = torch.cat(grids) if grids else None
        merge = cfg.vision.spatial_merge_size
        return MultimodalInputs(
            audio_features=features,
            num_audio_tokens=[audio_output_tokens(f.shape[1], cfg.audio.n_window) for f in features],
            pixel_values=torch.cat(patches) if patches else None,
            image_grid_thw=grid_thw,
            num_image_tokens=[] if grid_thw is None else [image_tokens(g, merge) for g in grid_thw.tolist()],
        )

    def _config(self):
        if self._thinker is None:
            self._thinker = Qwen3OmniConfig.from_dir(self._directory).thinker
        return self._thinker

    def _image_config(self) -> ImageProcessorConfig:
        if self._image_cfg is None:
            found = (self._directory / "preprocessor_config.json").exists()
            self._image_cfg = (
                ImageProcessorConfig.from_dir(self._directory) if found else ImageProcessorConfig()
            )
            merge = self._config().vision.spatial_merge_size
            if self._image_cfg.merge_size != merge:
                raise CheckpointError(
                    f"{self._directory}: preprocessor merge_size {self._image_cfg.merge_size} differs from the "
                    f"vision encoder's spatial_merge_size {merge}"
                )
        return self._image_cfg


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
    """A copy of `message` with `change` applied to its text content (a string, or its text parts)."""
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


def _media_parts(messages: list[dict]) -> tuple[list[tuple[str, object]], list[tuple[str, object]]]:
    """(where, value) of every audio and image part, in the order the template renders them."""
    audios, images = [], []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in AUDIO_PARTS:
                if kind != "audio" or "audio" not in part:
                    raise InvalidMedia(
                        f"{where}: an {kind} part must be decoded to {{'type': 'audio', 'audio': ...}}"
                    )
                audios.append((where, part["audio"]))
            elif kind in IMAGE_PARTS:
                if kind != "image" or "image" not in part:
                    raise InvalidMedia(
                        f"{where}: an {kind} part must be decoded to {{'type': 'image', 'image': ...}}"
                    )
                images.append((where, part["image"]))
            elif kind in VIDEO_PARTS:
                raise InvalidMedia(f"{where}: video input is not supported")
    return audios, images


def _waveform(audio: object) -> torch.Tensor:
    if not isinstance(audio, np.ndarray | torch.Tensor):
        raise InvalidMedia(f"audio must be a float32 waveform (numpy array), got {type(audio).__name__}")
    x = torch.as_tensor(audio)
    if not x.is_floating_point():
        raise InvalidMedia(f"audio must hold float samples, got {x.dtype}")
    # a sum is finite unless a sample is not (or the sum overflows: then the test of every sample decides),
    # and 30 times faster than that test on one thread (0.08 ms against 2.7 ms for 2 minutes of audio)
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise InvalidMedia("audio holds NaN or infinite samples")
    return x


def _image(image: object) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise InvalidMedia(f"image must be a PIL image, got {type(image).__name__}")
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise InvalidMedia(
            f"image is {image.width}x{image.height} pixels, more than the {MAX_DECODED_PIXELS:,} accepted"
        )
    return image


@contextmanager
def _part(where: str) -> Iterator[None]:
    """Name the content part in any InvalidMedia raised inside."""
    try:
        yield
    except InvalidMedia as exc:
        raise InvalidMedia(f"{where}: {exc}") from None
