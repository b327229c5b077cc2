"""Qwen3-ASR's prompts: one clip, an optional context (the system turn) and an optional forced language.

Shaped like the Qwen3-Omni processor where the server reads it (a ProcessedPrompt, `tokenizer`, `encode`,
`max_token_bytes`), so one server serves both; a chat to it is a transcription request: its system text is
the context, its one audio part the clip.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from tokenizers import Tokenizer

from omnistage.errors import InvalidRequest
from omnistage.models.multimodal import MultimodalInputs, clip_digest
from omnistage.models.qwen3_asr.audio_features import padded_clip
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_asr.output import parse_transcription
from omnistage.models.qwen3_asr.prompt import language_name, prompt_ids, prompt_text
from omnistage.models.qwen3_omni.audio_features import HOP_LENGTH, SAMPLE_RATE
from omnistage.models.qwen3_omni.processor import (
    ProcessedPrompt,
    check_text_size,
    encode_texts,
    longest_token_bytes,
)
from omnistage.models.qwen3_omni.transcription import max_transcription_tokens


class ASRProcessor:
    max_audios, max_images, max_videos = 1, 0, 0

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.cfg = Qwen3ASRConfig.from_dir(checkpoint_dir)
        self.tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
        self.max_token_bytes = longest_token_bytes(self.tokenizer)
        self.renders_tools = False  # a transcriber: its chat has no tools to render

    def transcription(
        self, audio: np.ndarray, language: str | None, context: str | None, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """The prompt of transcribing `audio` (16 kHz mono); a `language` the model does not know is an
        InvalidRequest listing those it does. `max_model_len` refuses text that cannot fit the context before it
        is tokenized, as the Qwen3-Omni processor does (the same check and encoding). The reply is capped by the
        clip's length.

        The clip goes to the engine as its waveform: the encoder stage makes the features of all the clips it
        admits at once, on its device, where the tower reads them (`log_mels`)."""
        name = language_name(language, self.cfg.languages) if language else None
        text = prompt_text(context or "", name)
        check_text_size(text, self.tokenizer, self.max_token_bytes, max_model_len)
        clip = padded_clip(audio)
        frames = clip.numel() // HOP_LENGTH  # the features' (`log_mel`)
        ids = prompt_ids(self.tokenizer, self.cfg, frames, context or "", name, max_model_len)
        mm = MultimodalInputs(
            audio_clips=[clip],
            num_audio_tokens=[ids.count(self.cfg.audio_token_id)],
            pixel_values=None,
            image_grid_thw=None,
            num_image_tokens=[],
            audio_keys=[clip_digest(clip)],
        )
        return ProcessedPrompt(
            text, ids, None, mm, max_tokens=max_transcription_tokens(len(audio) / SAMPLE_RATE)
        )

    def translation(
        self, audio: np.ndarray, prompt: str | None, max_model_len: int | None = None
    ) -> ProcessedPrompt:
        """Qwen3-ASR takes no instruction: it transcribes, and cannot be told to translate."""
        raise InvalidRequest(
            "this model transcribes only (Qwen3-ASR takes no instruction); translations need a Qwen3-Omni model"
        )

    def transcript(self, text: str) -> tuple[str | None, str]:
        """The language the model wrote (None for no speech, or when it was forced) and the transcript."""
        parsed = parse_transcription(text)
        return parsed.language, parsed.text

    def process_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        use_audio_in_video: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> ProcessedPrompt:
        """A chat of decoded parts as a transcription: the system turns' text is the context, and the user turns
        must hold exactly one audio part (their text is not read: the model takes no instruction; its prompt
        has no chat template, so `template_kwargs` change nothing). Its reply is
        capped by the clip's length, as the clip's transcription is, unless the request gives max_tokens."""
        context, clips = [], []
        for message in messages:
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
            for part in parts:
                if part.get("type") == "audio":
                    clips.append(part["audio"])
                elif part.get("type") == "image":
                    raise InvalidRequest("this model transcribes audio; it does not read images")
                elif part.get("type") == "video":
                    raise InvalidRequest("this model transcribes audio; it does not watch videos")
                elif message.get("role") == "system" and part.get("type") == "text":
                    context.append(part["text"])
        if len(clips) != 1:
            raise InvalidRequest(
                f"this model transcribes one audio clip per request; the messages hold {len(clips)}"
            )
        clip = np.asarray(clips[0], dtype=np.float32)
        return self.transcription(clip, None, "\n".join(context), max_model_len)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> NoReturn:
        raise InvalidRequest("this model transcribes audio: a chat to it needs one audio part")

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """Token ids of a raw prompt (completions): the model's own notation, control tokens included."""
        check_text_size(text, self.tokenizer, self.max_token_bytes, max_model_len)
        return encode_texts(self.tokenizer, [text], max_model_len)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
