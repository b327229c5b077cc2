"""A typed, validated view of a Qwen3-Omni `config.json`.

Only what omnistage serves is read. A config that cannot be served fails here, naming the key path and
the reason, instead of deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.errors import ConfigError


class _Reader:
    """Reads typed values out of one nested dict and names the full key path in every error."""

    def __init__(self, data: dict, path: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected an object, found {type(data).__name__}")
        self.data, self.path = data, path

    def child(self, key: str) -> _Reader:
        return _Reader(self.get(key, dict), f"{self.path}.{key}" if self.path else key)

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        where = f"{self.path}.{key}" if self.path else key
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise ConfigError(f"{where}: missing")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {kind.__name__}, found {value!r}")
        return value

    def positive(self, key: str) -> int:
        value = self.get(key, int)
        if value <= 0:
            raise ConfigError(f"{self.path}.{key}: must be positive, found {value}")
        return value

    def fail(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{self.path}.{key}: {reason}")


@dataclass(frozen=True)
class TextConfig:
    """A Qwen3 MoE decoder: the Thinker's or the Talker's language model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    max_position_embeddings: int

    @classmethod
    def read(cls, r: _Reader, experts_key: str) -> TextConfig:
        rope = r.child("rope_parameters")
        cfg = cls(
            vocab_size=r.positive("vocab_size"),
            hidden_size=r.positive("hidden_size"),
            num_hidden_layers=r.positive("num_hidden_layers"),
            num_attention_heads=r.positive("num_attention_heads"),
            num_key_value_heads=r.positive("num_key_value_heads"),
            head_dim=r.positive("head_dim"),
            rms_norm_eps=r.get("rms_norm_eps", float),
            rope_theta=rope.get("rope_theta", float),
            mrope_section=tuple(rope.get("mrope_section", list)),
            mrope_interleaved=rope.get("interleaved", bool, False)
            or rope.get("mrope_interleaved", bool, False),
            num_experts=r.positive(experts_key),
            num_experts_per_tok=r.positive("num_experts_per_tok"),
            moe_intermediate_size=r.positive("moe_intermediate_size"),
            norm_topk_prob=r.get("norm_topk_prob", bool, True),
            shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", int, 0),
            max_position_embeddings=r.positive("max_position_embeddings"),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise r.fail(
                "num_key_value_heads",
                f"{cfg.num_key_value_heads} does not divide num_attention_heads {cfg.num_attention_heads}",
            )
        if cfg.head_dim % 2 or sum(cfg.mrope_section) != cfg.head_dim // 2 or len(cfg.mrope_section) != 3:
            raise r.fail(
                "rope_parameters.mrope_section",
                f"{list(cfg.mrope_section)} must be 3 sections summing to head_dim/2 = {cfg.head_dim // 2}",
            )
        if cfg.num_experts_per_tok > cfg.num_experts:
            raise r.fail(
                "num_experts_per_tok", f"{cfg.num_experts_per_tok} exceeds the {cfg.num_experts} experts"
            )
        if r.get("decoder_sparse_step", int, 1) != 1 or r.get("mlp_only_layers", list, []):
            raise r.fail("mlp_only_layers", "omnistage serves decoders whose every layer is MoE")
        if r.get("sliding_window", int, None) is not None and r.get("use_sliding_window", bool, False):
            raise r.fail("sliding_window", "sliding-window attention is not supported in the decoder")
        return cfg

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    downsample_hidden_size: int
    output_dim: int
    n_window: int
    n_window_infer: int
    conv_chunksize: int
    max_source_positions: int
    activation_function: str

    @classmethod
    def read(cls, r: _Reader) -> AudioEncoderConfig:
        cfg = cls(
            num_mel_bins=r.positive("num_mel_bins"),
            d_model=r.positive("d_model"),
            encoder_layers=r.positive("encoder_layers"),
            encoder_attention_heads=r.positive("encoder_attention_heads"),
            encoder_ffn_dim=r.positive("encoder_ffn_dim"),
            downsample_hidden_size=r.positive("downsample_hidden_size"),
            output_dim=r.positive("output_dim"),
            n_window=r.positive("n_window"),
            n_window_infer=r.positive("n_window_infer"),
            conv_chunksize=r.positive("conv_chunksize"),
            max_source_positions=r.positive("max_source_positions"),
            activation_function=r.get("activation_function", str),
        )
        if cfg.d_model % cfg.encoder_attention_heads:
            raise r.fail(
                "encoder_attention_heads",
                f"{cfg.encoder_attention_heads} does not divide d_model {cfg.d_model}",
            )
        if cfg.n_window_infer % (2 * cfg.n_window):
            raise r.fail(
                "n_window_infer",
                f"{cfg.n_window_infer} is not a multiple of 2 * n_window ({2 * cfg.n_window})",
            )
        return cfg


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]

    @classmethod
    def read(cls, r: _Reader) -> VisionEncoderConfig:
        cfg = cls(
            depth=r.positive("depth"),
            hidden_size=r.positive("hidden_size"),
            num_heads=r.positive("num_heads"),
            intermediate_size=r.positive("intermediate_size"),
            hidden_act=r.get("hidden_act", str),
            in_channels=r.positive("in_channels"),
            patch_size=r.positive("patch_size"),
            temporal_patch_size=r.positive("temporal_patch_size"),
            spatial_merge_size=r.positive("spatial_merge_size"),
            out_hidden_size=r.positive("out_hidden_size"),
            num_position_embeddings=r.positive("num_position_embeddings"),
            deepstack_visual_indexes=tuple(r.get("deepstack_visual_indexes", list, [])),
        )
        bad = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
        if bad:
            raise r.fail("deepstack_visual_indexes", f"{bad} outside the {cfg.depth} vision blocks")
        side = round(cfg.num_position_embeddings**0.5)
        if side * side != cfg.num_position_embeddings:
            raise r.fail("num_position_embeddings", f"{cfg.num_position_embeddings} is not a square grid")
        return cfg


@dataclass(frozen=True)
class ThinkerConfig:
    text: TextConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    position_id_per_seconds: int

    @classmethod
    def read(cls, r: _Reader) -> ThinkerConfig:
        cfg = cls(
            text=TextConfig.read(r.child("text_config"), "num_experts"),
            audio=AudioEncoderConfig.read(r.child("audio_config")),
            vision=VisionEncoderConfig.read(r.child("vision_config")),
            audio_token_id=r.get("audio_token_id", int),
            image_token_id=r.get("image_token_id", int),
            video_token_id=r.get("video_token_id", int),
            audio_start_token_id=r.get("audio_start_token_id", int),
            audio_end_token_id=r.get("audio_end_token_id", int),
            vision_start_token_id=r.get("vision_start_token_id", int),
            vision_end_token_id=r.get("vision_end_token_id", int),
            position_id_per_seconds=r.positive("position_id_per_seconds"),
        )
        for key in ("audio_token_id", "image_token_id", "video_token_id"):
            if not 0 <= getattr(cfg, key) < cfg.text.vocab_size:
                raise r.fail(key, f"{getattr(cfg, key)} is outside the vocabulary of {cfg.text.vocab_size}")
        for key, size in (
            ("audio_config.output_dim", cfg.audio.output_dim),
            ("vision_config.out_hidden_size", cfg.vision.out_hidden_size),
        ):
            if size != cfg.text.hidden_size:
                raise r.fail(key, f"{size} differs from the text hidden size {cfg.text.hidden_size}")
        return cfg


@dataclass(frozen=True)
class CodePredictorConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_code_groups: int

    @classmethod
    def read(cls, r: _Reader) -> CodePredictorConfig:
        return cls(
            vocab_size=r.positive("vocab_size"),
            hidden_size=r.positive("hidden_size"),
            num_hidden_layers=r.positive("num_hidden_layers"),
            num_attention_heads=r.positive("num_attention_heads"),
            num_key_value_heads=r.positive("num_key_value_heads"),
            head_dim=r.positive("head_dim"),
            intermediate_size=r.positive("intermediate_size"),
            rms_norm_eps=r.get("rms_norm_eps", float),
            rope_theta=r.child("rope_parameters").get("rope_theta", float),
            num_code_groups=r.positive("num_code_groups"),
        )


@dataclass(frozen=True)
class TalkerConfig:
    text: TextConfig
    code_predictor: CodePredictorConfig
    thinker_hidden_size: int
    accept_hidden_layer: int
    num_code_groups: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_pad_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_id: dict[str, int]
    # the width inside text_projection / hidden_projection (thinker width -> this -> talker width)
    projection_intermediate_size: int

    @classmethod
    def read(cls, r: _Reader) -> TalkerConfig:
        return cls(
            text=TextConfig.read(r.child("text_config"), "num_local_experts"),
            code_predictor=CodePredictorConfig.read(r.child("code_predictor_config")),
            thinker_hidden_size=r.positive("thinker_hidden_size"),
            accept_hidden_layer=r.get("accept_hidden_layer", int),
            num_code_groups=r.positive("num_code_groups"),
            codec_bos_id=r.get("codec_bos_id", int),
            codec_eos_token_id=r.get("codec_eos_token_id", int),
            codec_pad_id=r.get("codec_pad_id", int),
            codec_nothink_id=r.get("codec_nothink_id", int),
            codec_think_bos_id=r.get("codec_think_bos_id", int),
            codec_think_eos_id=r.get("codec_think_eos_id", int),
            speaker_id=dict(r.get("speaker_id", dict)),
            projection_intermediate_size=r.child("text_config").positive("intermediate_size"),
        )


@dataclass(frozen=True)
class Code2WavConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    codebook_size: int
    num_quantizers: int
    decoder_dim: int
    sliding_window: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def read(cls, r: _Reader) -> Code2WavConfig:
        return cls(
            hidden_size=r.positive("hidden_size"),
            num_hidden_layers=r.positive("num_hidden_layers"),
            num_attention_heads=r.positive("num_attention_heads"),
            num_key_value_heads=r.positive("num_key_value_heads"),
            intermediate_size=r.positive("intermediate_size"),
            codebook_size=r.positive("codebook_size"),
            num_quantizers=r.positive("num_quantizers"),
            decoder_dim=r.positive("decoder_dim"),
            sliding_window=r.positive("sliding_window"),
            upsample_rates=tuple(r.get("upsample_rates", list)),
            upsampling_ratios=tuple(r.get("upsampling_ratios", list)),
            rms_norm_eps=r.get("rms_norm_eps", float),
            rope_theta=r.child("rope_parameters").get("rope_theta", float),
        )

    @property
    def samples_per_frame(self) -> int:
        total = 1
        for rate in (*self.upsample_rates, *self.upsampling_ratios):
            total *= rate
        return total


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    enable_audio_output: bool
    im_start_token_id: int
    im_end_token_id: int
    user_token_id: int
    assistant_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    tts_pad_token_id: int
    raw: dict

    @classmethod
    def from_dict(cls, data: dict) -> Qwen3OmniConfig:
        r = _Reader(data, "")
        model_type = r.get("model_type", str)
        if model_type != "qwen3_omni_moe":
            raise ConfigError(f"model_type: omnistage serves 'qwen3_omni_moe' here, found {model_type!r}")
        thinker = ThinkerConfig.read(r.child("thinker_config"))
        talker = TalkerConfig.read(r.child("talker_config"))
        if not 0 <= talker.accept_hidden_layer <= thinker.text.num_hidden_layers:
            raise ConfigError(
                f"talker_config.accept_hidden_layer: {talker.accept_hidden_layer} is outside the thinker's "
                f"{thinker.text.num_hidden_layers} layers"
            )
        return cls(
            thinker=thinker,
            talker=talker,
            code2wav=Code2WavConfig.read(r.child("code2wav_config")),
            enable_audio_output=r.get("enable_audio_output", bool, True),
            im_start_token_id=r.get("im_start_token_id", int),
            im_end_token_id=r.get("im_end_token_id", int),
            user_token_id=r.get("user_token_id", int),
            assistant_token_id=r.get("assistant_token_id", int),
            tts_bos_token_id=r.get("tts_bos_token_id", int),
            tts_eos_token_id=r.get("tts_eos_token_id", int),
            tts_pad_token_id=r.get("tts_pad_token_id", int),
            raw=data,
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> Qwen3OmniConfig:
        return cls.from_dict(read_config_json(directory))


def read_config_json(directory: str | Path) -> dict:
    """A checkpoint directory's config.json, or a ConfigError saying what is missing or unreadable."""
    if not Path(directory).is_dir():
        raise ConfigError(f"{directory}: the checkpoint directory does not exist")
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the checkpoint directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
