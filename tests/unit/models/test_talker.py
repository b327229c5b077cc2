"""Loading the Talker from the released `talker.*` names (all but `talker.code_predictor.*`)."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.errors import CheckpointError
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.talker import load_talker


def talker_tensors(checkpoint) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if name.startswith("talker.")}


def write_talker_checkpoint(directory, checkpoint, tensors: dict[str, torch.Tensor]):
    directory.mkdir()
    shutil.copy(checkpoint / "config.json", directory / "config.json")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_every_talker_tensor_but_the_code_predictor_lands_in_its_parameter(tiny_checkpoint):
    talker = load_talker(tiny_checkpoint, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())
    params = talker.state_dict()
    tensors = talker_tensors(tiny_checkpoint)
    own = [name for name in tensors if not name.startswith("talker.code_predictor.")]
    assert len(own) < len(tensors)  # the tiny checkpoint does hold code-predictor tensors to leave alone
    inter = talker.config.text.moe_intermediate_size
    for name in own:
        local = name.removeprefix("talker.")
        if ".experts." in local:
            layer, rest = local.split(".experts.")
            expert, proj = rest.split(".")[:2]
            if proj == "down_proj":
                mine = params[f"{layer}.experts.w2"][int(expert)]
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                mine = params[f"{layer}.experts.w13"][int(expert), rows]
        else:
            mine = params[local]
        torch.testing.assert_close(mine, tensors[name].float(), rtol=0, atol=0, msg=name)
    assert not any(name.startswith("code_predictor") for name in params)


def test_a_stray_talker_tensor_is_reported(tiny_checkpoint, tmp_path):
    tensors = talker_tensors(tiny_checkpoint)
    tensors["talker.model.layers.0.mlp.extra_gate.weight"] = torch.zeros(1, 32)
    directory = write_talker_checkpoint(tmp_path / "ckpt", tiny_checkpoint, tensors)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) under 'talker.'.*layers\.0\.mlp\.extra_gate"):
        load_talker(directory, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())


@pytest.mark.parametrize(
    "dropped", ["talker.codec_head.weight", "talker.model.layers.1.mlp.experts.3.up_proj.weight"]
)
def test_a_missing_talker_tensor_is_reported(tiny_checkpoint, tmp_path, dropped):
    tensors = talker_tensors(tiny_checkpoint)
    del tensors[dropped]
    directory = write_talker_checkpoint(tmp_path / "ckpt", tiny_checkpoint, tensors)
    with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) missing from the checkpoint: {dropped}$"):
        load_talker(directory, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())


def test_the_talker_loads_without_code_predictor_tensors(tiny_checkpoint, tmp_path):
    tensors = {
        name: tensor
        for name, tensor in talker_tensors(tiny_checkpoint).items()
        if not name.startswith("talker.code_predictor.")
    }
    directory = write_talker_checkpoint(tmp_path / "ckpt", tiny_checkpoint, tensors)
    talker = load_talker(directory, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())
    torch.testing.assert_close(
        talker.codec_head.weight, tensors["talker.codec_head.weight"].float(), rtol=0, atol=0
    )


def test_dummy_weights_need_only_the_config(tmp_path, tiny_checkpoint):
    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", directory / "config.json")
    talker = load_talker(
        directory, LoadOptions(torch.float32, "cpu", load_format="dummy"), TorchReferenceBackend()
    )
    assert all(not p.is_meta and torch.isfinite(p).all() for p in talker.parameters())
