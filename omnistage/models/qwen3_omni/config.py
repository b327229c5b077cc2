"""A typed, validated view of a Qwen3-Omni `config.json`.

Only what omnistage serves is read. A config that cannot be served fails here, naming the key path and
the reason, instead of deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omnistage.errors import ConfigError
from omnistage.models.config_reader import ConfigReader, DecoderConfig, Size, read_config_json

RELEASED_INSTRUCT = "qwen3_omni_30b_a3b_instruct.config.json"  # package data, omnistage/data/


@dataclass(frozen=True)
class TextConfig(DecoderConfig):
    """A Qwen3 MoE decoder: the Thinker's or the Talker's language model."""

    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    num_experts: Size
    num_experts_per_tok: Size
    moe_intermediate_size: Size
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    max_position_embeddings: Size

    @classmethod
    def read(cls, r: ConfigReader, experts_key: str) -> TextConfig:
        rope = r.child("rope_parameters")
        cfg = r.read(
            cls,
            rope_theta=rope.get("rope_theta", float),
            mrope_section=tuple(rope.get("mrope_section", list)),
            mrope_interleaved=rope.get("interleaved", bool, False)
            or rope.get("mrope_interleaved", bool, False),
            num_experts=r.positive(experts_key),
            norm_topk_prob=r.get("norm_topk_prob", bool, True),
            shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", int, 0),
        )
        cfg.check_heads(r)
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


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: Size
    d_model: Size
    encoder_layers: Size
    encoder_attention_heads: Size
    encoder_ffn_dim: Size
    downsample_hidden_size: Size
    output_dim: Size
    n_window: Size
    n_window_infer: Size
    conv_chunksize: Size
    max_source_positions: Size
    activation_function: str

    @classmethod
    def read(cls, r: ConfigReader) -> AudioEncoderConfig:
        cfg = r.read(cls)
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
    depth: Size
    hidden_size: Size
    num_heads: Size
    intermediate_size: Size
    hidden_act: str
    in_channels: Size
    patch_size: Size
    temporal_patch_size: Size
    spatial_merge_size: Size
    out_hidden_size: Size
    num_position_embeddings: Size
    deepstack_visual_indexes: tuple[int, ...]

    @classmethod
    def read(cls, r: ConfigReader) -> VisionEncoderConfig:
        cfg = r.read(cls, deepstack_visual_indexes=tuple(r.get("deepstack_visual_indexes", list, [])))
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
    position_id_per_seconds: Size

    @classmethod
    def read(cls, r: ConfigReader) -> ThinkerConfig:
        cfg = r.read(
            cls,
            text=TextConfig.read(r.child("text_config"), "num_experts"),
            audio=AudioEncoderConfig.read(r.child("audio_config")),
            vision=VisionEncoderConfig.read(r.child("vision_config")),
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
class CodePredictorConfig(DecoderConfig):
    intermediate_size: Size
    num_code_groups: Size

    @classmethod
    def read(cls, r: ConfigReader) -> CodePredictorConfig:
        return r.read(cls, rope_theta=r.child("rope_parameters").get("rope_theta", float))


@dataclass(frozen=True)
class TalkerConfig:
    text: TextConfig
    code_predictor: CodePredictorConfig
    thinker_hidden_size: Size
    accept_hidden_layer: int
    num_code_groups: Size
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
    def read(cls, r: ConfigReader) -> TalkerConfig:
        return r.read(
            cls,
            text=TextConfig.read(r.child("text_config"), "num_local_experts"),
            code_predictor=CodePredictorConfig.read(r.child("code_predictor_config")),
            projection_intermediate_size=r.child("text_config").positive("intermediate_size"),
        )


@dataclass(frozen=True)
class Code2WavConfig:
    hidden_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    intermediate_size: Size
    codebook_size: Size
    num_quantizers: Size
    decoder_dim: Size
    sliding_window: Size
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def read(cls, r: ConfigReader) -> Code2WavConfig:
        return r.read(cls, rope_theta=r.child("rope_parameters").get("rope_theta", float))

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
        r = ConfigReader.of_model(data, "qwen3_omni_moe")
        thinker = ThinkerConfig.read(r.child("thinker_config"))
        # The released Thinking checkpoint's config.json has no talker_config: without one there is no Talker
        # to build, whatever enable_audio_output says by its absence.
        enable_audio_output = r.get("enable_audio_output", bool, data.get("talker_config") is not None)
        if not enable_audio_output:
            r = ConfigReader.of_model(_speech_sections_filled(data), "qwen3_omni_moe")
        talker = TalkerConfig.read(r.child("talker_config"))
        if enable_audio_output and not 0 <= talker.accept_hidden_layer <= thinker.text.num_hidden_layers:
            raise ConfigError(
                f"talker_config.accept_hidden_layer: {talker.accept_hidden_layer} is outside the thinker's "
                f"{thinker.text.num_hidden_layers} layers"
            )
        return r.read(
            cls,
            thinker=thinker,
            talker=talker,
            code2wav=Code2WavConfig.read(r.child("code2wav_config")),
            enable_audio_output=enable_audio_output,
            raw=data,
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> Qwen3OmniConfig:
        return cls.from_dict(read_config_json(directory))


def _speech_sections_filled(data: dict) -> dict:
    """`data` of a checkpoint without a Talker, a missing `talker_config` or `code2wav_config` filled in from
    the released Instruct config: transformers fills them with defaults too, and nothing reads them where no
    Talker is built, but the config stays one shape for the code that takes it."""
    released = json.loads((resources.files("omnistage") / "data" / RELEASED_INSTRUCT).read_text())
    filled = dict(data)
    for name in ("talker_config", "code2wav_config"):
        if filled.get(name) is None:
            filled[name] = released[name]
    return filled
