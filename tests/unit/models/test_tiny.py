import hashlib
import json
import re
from pathlib import Path

from safetensors import safe_open

from omnistage.cli import main
from omnistage.models.qwen3_omni import tiny
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import make_tiny


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_checkpoint):
    again = make_tiny(tmp_path / "again", seed=0)
    other = make_tiny(tmp_path / "other", seed=1)
    assert _digest(again) == _digest(tiny_checkpoint)
    assert _digest(other)["model.safetensors"] != _digest(tiny_checkpoint)["model.safetensors"]
    assert _digest(other)["config.json"] == _digest(tiny_checkpoint)["config.json"]


def _pattern(name):
    return re.sub(r"\.\d+(-\d+)?(?=\.)", ".N", name)


# Every tensor of the released checkpoint (name, shape, dtype, shard; repeated layers/experts folded as ranges).
RELEASED_WEIGHTS = Path(__file__).parents[2] / "data" / "qwen3_omni_30b_a3b_instruct.weights.tsv"


def test_tensor_names_follow_the_released_file_layout(tiny_checkpoint):
    rows = RELEASED_WEIGHTS.read_text().splitlines()[1:]
    released_patterns = {_pattern(row.split("\t")[0]) for row in rows}
    with safe_open(str(tiny_checkpoint / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names}
    assert {_pattern(n) for n in names} == released_patterns
    assert "thinker.model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert dtypes == {"BF16"}


def test_config_keeps_released_ids_and_shrinks_sizes(tiny_checkpoint):
    config = Qwen3OmniConfig.from_dir(tiny_checkpoint)
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    released = tiny.released_config()
    assert raw["model_type"] == "qwen3_omni_moe"
    assert config.thinker.audio_token_id == 151675
    assert config.thinker.image_token_id == 151655
    assert config.thinker.text.vocab_size == 152064
    assert config.talker.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert config.talker.codec_bos_id == 2149 and config.talker.codec_eos_token_id == 2150
    assert config.tts_pad_token_id == 151671 and config.tts_bos_token_id == 151672
    assert (
        config.thinker.text.num_hidden_layers < released["thinker_config"]["text_config"]["num_hidden_layers"]
    )
    assert config.code2wav.samples_per_frame == 1920


def test_default_checkpoint_is_made_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    made = []
    real = tiny.make_tiny
    monkeypatch.setattr(tiny, "make_tiny", lambda d: made.append(d) or real(d))
    first = tiny.default_checkpoint()
    second = tiny.default_checkpoint()
    assert first == second and first.parent == tmp_path
    assert (first / "model.safetensors").exists() and (first / "tokenizer.json").exists()
    assert len(made) == 1
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_make_tiny_variant_thinking_writes_the_thinker_alone(tmp_path, tiny_thinking_checkpoint):
    main(["make-tiny", str(tmp_path / "thinking"), "--variant", "thinking"])
    assert _digest(tmp_path / "thinking") == _digest(tiny_thinking_checkpoint)
    config = json.loads((tmp_path / "thinking" / "config.json").read_text())
    assert config["enable_audio_output"] is False
    assert not Qwen3OmniConfig.from_dir(tmp_path / "thinking").enable_audio_output
    with safe_open(str(tmp_path / "thinking" / "model.safetensors"), "pt") as f:
        assert f.keys() and all(name.startswith("thinker.") for name in f.keys())
