"""A typed, validated view of a Qwen3-ASR `config.json`, in either of its two layouts.

The released checkpoints (`Qwen/Qwen3-ASR-{0.6B,1.7B}`, read by the `qwen-asr` package and vLLM) nest the
model under `thinker_config` and name tensors `thinker.*`; transformers' own conversions (`-hf`) flatten
`audio_config`, `text_config` and `audio_token_id` to the top level and name tensors `model.*` / `lm_head.*`.
`omnistage/data/qwen3_asr_*.config.json` record the released layout at the released sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omnistage.models.config_reader import ConfigReader, DecoderConfig, Size, read_config_json
from omnistage.models.qwen3_omni.audio_encoder import audio_output_tokens
from omnistage.models.qwen3_omni.config import AudioEncoderConfig

Layout = Literal["released", "hf"]

# Token ids both layouts share with the released tokenizer; the -hf config keeps only audio_token_id.
AUDIO_START_TOKEN_ID = 151669
AUDIO_END_TOKEN_ID = 151670
# The released transformers backend's stop ids and greedy cap (its generation_config.json).
EOS_TOKEN_IDS = (151643, 151645)
# The conv stack's peak: the released audio_config's conv_chunksize; the -hf config has none.
DEFAULT_CONV_CHUNKSIZE = 500


@dataclass(frozen=True)
class DenseTextConfig(DecoderConfig):
    """A dense Qwen3 decoder (q/k RMSNorm, GQA, SwiGLU MLP, RoPE)."""

    intermediate_size: Size
    max_position_embeddings: Size
    tie_word_embeddings: bool

    @classmethod
    def read(cls, r: ConfigReader, tie_default: bool) -> DenseTextConfig:
        # transformers 5 nests rope_theta in rope_parameters; the released (4.57) file has it at the top
        rope = r.data.get("rope_parameters") or {}
        theta = r.child("rope_parameters").get("rope_theta", float) if rope else r.get("rope_theta", float)
        cfg = r.read(
            cls,
            rope_theta=theta,
            tie_word_embeddings=r.get("tie_word_embeddings", bool, tie_default),
        )
        cfg.check_heads(r)
        if cfg.head_dim % 2:
            raise r.fail("head_dim", f"{cfg.head_dim} must be even for rotary embeddings")
        if r.get("hidden_act", str, "silu") != "silu":
            raise r.fail(
                "hidden_act", f"omnistage serves SiLU-gated MLPs, found {r.get('hidden_act', str)!r}"
            )
        if r.get("attention_bias", bool, False):
            raise r.fail("attention_bias", "attention projections with biases are not supported")
        if r.get("use_sliding_window", bool, False):
            raise r.fail("use_sliding_window", "sliding-window attention is not supported in the decoder")
        # M-RoPE sections, where given, only matter for positions that differ between streams; ASR
        # positions are the same on all three, so every layout reduces to plain RoPE. Still check them.
        scaling = r.data.get("rope_scaling") or rope
        section = scaling.get("mrope_section") if isinstance(scaling, dict) else None
        if section is not None and sum(section) != cfg.head_dim // 2:
            raise r.fail(
                "rope_scaling.mrope_section", f"{section} does not sum to head_dim/2 = {cfg.head_dim // 2}"
            )
        return cfg


def _audio_config(r: ConfigReader, layout: Layout) -> AudioEncoderConfig:
    """The AuT's settings as the Omni encoder reads them, from either layout's audio_config."""
    if layout == "released":
        cfg = AudioEncoderConfig.read(r)
    else:
        heads = "encoder_attention_heads" if "encoder_attention_heads" in r.data else "num_attention_heads"
        cfg = r.read(
            AudioEncoderConfig,
            encoder_attention_heads=r.positive(heads),
            conv_chunksize=DEFAULT_CONV_CHUNKSIZE,
            # transformers' table holds one chunk's positions (13 for n_window 50); ours needs no table
            max_source_positions=r.positive("max_position_embeddings"),
        )
        chunk_tokens = audio_output_tokens(2 * cfg.n_window, cfg.n_window)
        if cfg.max_source_positions < chunk_tokens:
            raise r.fail(
                "max_position_embeddings",
                f"{cfg.max_source_positions} positions cannot hold one chunk's {chunk_tokens} tokens",
            )
        if cfg.d_model % cfg.encoder_attention_heads or cfg.n_window_infer % (2 * cfg.n_window):
            raise r.fail("n_window_infer", "heads must divide d_model and windows must hold whole chunks")
    if r.get("scale_embedding", bool, False):
        raise r.fail("scale_embedding", "scaled audio embeddings are not supported")
    return cfg


@dataclass(frozen=True)
class Qwen3ASRConfig:
    layout: Layout
    text: DenseTextConfig
    audio: AudioEncoderConfig
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    # The names the model writes after "language " (released: support_languages; -hf: not recorded).
    languages: tuple[str, ...]
    raw: dict

    @classmethod
    def from_dict(cls, data: dict) -> Qwen3ASRConfig:
        r = ConfigReader.of_model(data, "qwen3_asr")
        layout: Layout = "released" if "thinker_config" in data else "hf"
        model = r.child("thinker_config") if layout == "released" else r
        if layout == "released" and model.data.get("classify_num") is not None:
            raise model.fail("classify_num", "this is a forced aligner, not a transcription model")
        tie = model.get("tie_word_embeddings", bool, r.get("tie_word_embeddings", bool, True))
        cfg = cls(
            layout=layout,
            text=DenseTextConfig.read(model.child("text_config"), tie),
            audio=_audio_config(model.child("audio_config"), layout),
            audio_token_id=model.get("audio_token_id", int),
            audio_start_token_id=model.get("audio_start_token_id", int, AUDIO_START_TOKEN_ID),
            audio_end_token_id=model.get("audio_end_token_id", int, AUDIO_END_TOKEN_ID),
            languages=tuple(r.get("support_languages", list, [])),
            raw=data,
        )
        for key in ("audio_token_id", "audio_start_token_id", "audio_end_token_id"):
            if not 0 <= getattr(cfg, key) < cfg.text.vocab_size:
                raise model.fail(
                    key, f"{getattr(cfg, key)} is outside the vocabulary of {cfg.text.vocab_size}"
                )
        if cfg.audio.output_dim != cfg.text.hidden_size:
            raise model.fail(
                "audio_config.output_dim",
                f"{cfg.audio.output_dim} differs from the text hidden size {cfg.text.hidden_size}",
            )
        return cfg

    @classmethod
    def from_dir(cls, directory: str | Path) -> Qwen3ASRConfig:
        return cls.from_dict(read_config_json(directory))
