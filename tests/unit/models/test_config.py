import json

import pytest

from omnistage.errors import ConfigError
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config, variant_config


def test_released_config_reads_the_released_sizes():
    config = Qwen3OmniConfig.from_dict(released_config())
    text = config.thinker.text
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (128, 8, 768)
    assert text.mrope_section == (24, 20, 20) and text.mrope_interleaved
    assert text.kv_bytes_per_token == 96 * 1024
    assert config.talker.text.shared_expert_intermediate_size == 768
    assert config.thinker.vision.deepstack_visual_indexes == (8, 16, 24)
    assert config.thinker.audio.encoder_layers == 32
    assert (config.im_start_token_id, config.user_token_id, config.assistant_token_id) == (151644, 872, 77091)


def _broken(edit):
    data = released_config()
    edit(data)
    return data


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(model_type="llama"),
            "model_type: omnistage serves 'qwen3_omni_moe' here, found 'llama'",
        ),
        (
            lambda d: d["thinker_config"]["text_config"].pop("hidden_size"),
            "thinker_config.text_config.hidden_size: missing",
        ),
        (
            lambda d: d["thinker_config"]["text_config"].update(num_key_value_heads=5),
            "thinker_config.text_config.num_key_value_heads: 5 does not divide num_attention_heads 32",
        ),
        (
            lambda d: d["thinker_config"]["text_config"].update(num_hidden_layers="48"),
            "thinker_config.text_config.num_hidden_layers: expected int, found '48'",
        ),
        (
            lambda d: d["thinker_config"]["text_config"]["rope_parameters"].update(
                mrope_section=[24, 20, 24]
            ),
            "thinker_config.text_config.rope_parameters.mrope_section: [24, 20, 24] must be 3 sections summing to head_dim/2 = 64",
        ),
        (
            lambda d: d["thinker_config"]["text_config"].update(num_experts_per_tok=200),
            "thinker_config.text_config.num_experts_per_tok: 200 exceeds the 128 experts",
        ),
        (
            lambda d: d["thinker_config"]["vision_config"].update(deepstack_visual_indexes=[8, 30]),
            "thinker_config.vision_config.deepstack_visual_indexes: [30] outside the 27 vision blocks",
        ),
        (
            lambda d: d["thinker_config"]["audio_config"].update(output_dim=1024),
            "thinker_config.audio_config.output_dim: 1024 differs from the text hidden size 2048",
        ),
        (
            lambda d: d["talker_config"].update(accept_hidden_layer=60),
            "talker_config.accept_hidden_layer: 60 is outside the thinker's 48 layers",
        ),
        (lambda d: d.update(thinker_config=[]), "thinker_config: expected dict, found []"),
    ],
)
def test_unservable_configs_name_the_key_and_reason(edit, message):
    with pytest.raises(ConfigError) as err:
        Qwen3OmniConfig.from_dict(_broken(edit))
    assert str(err.value) == message


def test_from_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json in the checkpoint directory"):
        Qwen3OmniConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: unreadable"):
        Qwen3OmniConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    assert Qwen3OmniConfig.from_dir(tmp_path).thinker.text.vocab_size == 152064


def test_a_checkpoint_without_a_talker_may_leave_its_sections_out():
    thinking = variant_config("thinking")
    del thinking["talker_config"], thinking["code2wav_config"]
    config = Qwen3OmniConfig.from_dict(thinking)
    assert not config.enable_audio_output
    assert (
        config.thinker.text.num_hidden_layers
        == thinking["thinker_config"]["text_config"]["num_hidden_layers"]
    )
    del thinking["enable_audio_output"]  # the released Thinking config.json: no talker_config, nor the flag
    assert not Qwen3OmniConfig.from_dict(thinking).enable_audio_output
    instruct = variant_config("instruct")
    del instruct["talker_config"]
    with pytest.raises(ConfigError, match="talker_config: missing"):
        Qwen3OmniConfig.from_dict(instruct | {"enable_audio_output": True})
