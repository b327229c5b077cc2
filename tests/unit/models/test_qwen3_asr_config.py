"""The Qwen3-ASR config view, prompt and parser on hand-made inputs, and `make-tiny --family qwen3-asr`."""

from __future__ import annotations

import copy
import json

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from omnistage.cli import main
from omnistage.errors import ConfigError, InvalidRequest
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_asr.output import Transcription, collapse_repeats, parse_transcription
from omnistage.models.qwen3_asr.prompt import language_name, prompt_ids
from omnistage.models.qwen3_asr.tiny import hf_config, released_config, tiny_config


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("asr")
    assert main(["make-tiny", str(root / "released"), "--family", "qwen3-asr"]) == 0
    assert main(["make-tiny", str(root / "hf"), "--family", "qwen3-asr", "--layout", "hf"]) == 0
    return {"released": root / "released", "hf": root / "hf"}


def names(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("file", ["qwen3_asr_1p7b.config.json", "qwen3_asr_0p6b.config.json"])
def test_released_configs_read_at_their_sizes(file):
    cfg = Qwen3ASRConfig.from_dict(released_config(file))
    big = file.startswith("qwen3_asr_1p7b")
    assert cfg.layout == "released"
    assert (cfg.audio.encoder_layers, cfg.audio.d_model, cfg.text.hidden_size) == (
        (24, 1024, 2048) if big else (18, 896, 1024)
    )
    assert cfg.audio_token_id == 151676 and cfg.text.tie_word_embeddings and len(cfg.languages) == 30


def test_both_layouts_read_the_same_model():
    released = Qwen3ASRConfig.from_dict(tiny_config())
    hf = Qwen3ASRConfig.from_dict(hf_config(tiny_config()))
    assert hf.layout == "hf" and released.layout == "released"
    assert hf.text == released.text
    assert (hf.audio_token_id, hf.audio_start_token_id, hf.audio_end_token_id) == (151676, 151669, 151670)
    assert (
        hf.audio.d_model == released.audio.d_model
        and hf.audio.n_window_infer == released.audio.n_window_infer
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(model_type="qwen3_omni_moe"), "model_type"),
        (lambda c: c["thinker_config"].update(classify_num=5000), "forced aligner"),
        (lambda c: c["thinker_config"]["text_config"].update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c["thinker_config"]["audio_config"].update(output_dim=48), "output_dim"),
        (lambda c: c["thinker_config"]["text_config"].pop("hidden_size"), "text_config.hidden_size: missing"),
        (lambda c: c["thinker_config"]["text_config"].update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_configs_name_the_key(change, message):
    config = copy.deepcopy(tiny_config())
    change(config)
    with pytest.raises(ConfigError, match=message):
        Qwen3ASRConfig.from_dict(config)


def test_make_tiny_writes_each_layout_names(tiny_dirs):
    released, hf = names(tiny_dirs["released"]), names(tiny_dirs["hf"])
    assert "thinker.audio_tower.proj1.weight" in released and "thinker.lm_head.weight" in released
    assert "model.multi_modal_projector.linear_2.bias" in hf and "lm_head.weight" not in hf
    assert all(n.startswith("thinker.") for n in released)
    assert len(released) == len(hf) + 1  # the released files carry the tied head
    assert Qwen3ASRConfig.from_dir(tiny_dirs["hf"]).layout == "hf"
    tokenizer_config = json.loads((tiny_dirs["hf"] / "tokenizer_config.json").read_text())
    assert tokenizer_config["extra_special_tokens"]["audio_token"] == "<|audio_pad|>"


def test_tokenizer_places_the_asr_tokens(tiny_dirs):
    tokenizer = Tokenizer.from_file(str(tiny_dirs["released"] / "tokenizer.json"))
    assert tokenizer.token_to_id("<|audio_pad|>") == 151676
    assert tokenizer.token_to_id("<asr_text>") == 151704
    ids = tokenizer.encode("language English<asr_text>hi", add_special_tokens=False).ids
    assert 151704 in ids and tokenizer.decode(ids, skip_special_tokens=True) == "language English<asr_text>hi"


def test_prompt_expands_the_audio_and_forces_the_language(tiny_dirs):
    tokenizer = Tokenizer.from_file(str(tiny_dirs["released"] / "tokenizer.json"))
    cfg = Qwen3ASRConfig.from_dir(tiny_dirs["released"])
    plain = prompt_ids(tokenizer, cfg, mel_frames=250)
    assert plain.count(151676) == 13 + 13 + 7  # two whole 1 s chunks and 50 frames
    assert plain[:3] == [151644, tokenizer.token_to_id("system"), 198]
    forced = prompt_ids(tokenizer, cfg, mel_frames=250, context="Names: Ada", language="English")
    text = tokenizer.decode(forced, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nNames: Ada<|im_end|>\n<|im_start|>user\n<|audio_start|>")
    assert text.endswith("<|audio_end|><|im_end|>\n<|im_start|>assistant\nlanguage English<asr_text>")
    assert forced[-1] == 151704
    with pytest.raises(InvalidRequest, match="control token"):
        prompt_ids(tokenizer, cfg, mel_frames=250, context="<|im_end|>")


def test_language_names():
    assert language_name("en") == "English"
    assert language_name(" ENGLISH ") == "English"
    assert language_name("yue") == "Cantonese"
    assert language_name("de", known=("German", "English")) == "German"
    with pytest.raises(InvalidRequest, match="xx.*knows: zh \\(Chinese\\), en \\(English\\)"):
        language_name("xx")
    with pytest.raises(InvalidRequest, match="knows: en \\(English\\)$"):
        language_name("de", known=("English",))


def test_parser_and_repeats():
    assert parse_transcription("language English<asr_text> Hi. ") == Transcription("English", "Hi.")
    assert parse_transcription("language None<asr_text>") == Transcription(None, "")
    assert parse_transcription("plain") == Transcription(None, "plain")
    assert collapse_repeats("a" * 21 + "b") == "ab"
    assert collapse_repeats("a" * 20 + "b") == "a" * 20 + "b"  # 21 characters: too short to look for patterns
    assert collapse_repeats("xy" * 20 + "z" * 3) == "xyzzz"
