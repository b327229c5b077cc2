import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.errors import CheckpointError
from omnistage.models.loader import LoadOptions, checkpoint_files, load_model, load_weights

EXPERTS, HIDDEN, WIDTH = 3, 4, 2


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(EXPERTS, 2 * WIDTH, HIDDEN))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, WIDTH))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.experts = Experts()
        self.register_buffer("freqs", torch.arange(3.0), persistent=False)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])


def file_tensors(prefix="thinker."):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(2):
        p = f"{prefix}layers.{i}."
        tensors[p + "proj.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        tensors[p + "proj.bias"] = torch.randn(HIDDEN, generator=g)
        tensors[p + "norm.weight"] = torch.randn(HIDDEN, generator=g)
        tensors[p + "norm.bias"] = torch.randn(HIDDEN, generator=g)
        for e in range(EXPERTS):
            for proj, shape in (
                ("gate", (WIDTH, HIDDEN)),
                ("up", (WIDTH, HIDDEN)),
                ("down", (HIDDEN, WIDTH)),
            ):
                tensors[f"{p}experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=g)
    tensors["talker.other.weight"] = torch.randn(
        2, generator=g
    )  # another component: ignored under 'thinker.'
    return tensors


def test_round_trip_equals_the_saved_tensors_with_experts_stacked(tmp_path):
    tensors = file_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = Toy()
    load_weights(model, tmp_path, "thinker.", dtype=torch.float64)
    block = model.layers[1]
    assert block.proj.weight.dtype == torch.float64
    assert torch.equal(block.proj.weight, tensors["thinker.layers.1.proj.weight"].double())
    assert torch.equal(block.norm.bias, tensors["thinker.layers.1.norm.bias"].double())
    for e in range(EXPERTS):
        gate = tensors[f"thinker.layers.1.experts.{e}.gate_proj.weight"].double()
        up = tensors[f"thinker.layers.1.experts.{e}.up_proj.weight"].double()
        down = tensors[f"thinker.layers.1.experts.{e}.down_proj.weight"].double()
        assert torch.equal(block.experts.w13[e], torch.cat([gate, up]))
        assert torch.equal(block.experts.w2[e], down)
    assert torch.equal(block.freqs, torch.arange(3.0))  # derived buffers are not touched


def test_meta_module_is_materialised_and_buffers_recomputed(tmp_path):
    save_file(file_tensors(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Toy()
    for block in model.layers:
        block.init_buffers = lambda b=block: b.register_buffer("freqs", torch.arange(3.0), persistent=False)
    load_weights(model, tmp_path, "thinker.", dtype=torch.bfloat16, device="cpu")
    assert model.layers[0].proj.weight.device.type == "cpu"
    assert model.layers[0].proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.layers[0].freqs, torch.arange(3.0))


def test_sharded_index(tmp_path):
    tensors = file_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert set(checkpoint_files(tmp_path)) == set(tensors)
    model = Toy()
    load_weights(model, tmp_path, "thinker.")
    assert torch.equal(model.layers[0].experts.w2[2], tensors["thinker.layers.0.experts.2.down_proj.weight"])


def test_missing_shard_is_named(tmp_path):
    weight_map = {"thinker.layers.0.proj.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"shard file\(s\) missing: model-00002-of-00002.safetensors"):
        load_weights(Toy(), tmp_path, "thinker.")


def test_missing_tensors_are_listed(tmp_path):
    tensors = file_tensors()
    del tensors["thinker.layers.0.norm.bias"]
    del tensors["thinker.layers.1.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_weights(Toy(), tmp_path, "thinker.")
    assert "2 tensor(s) missing from the checkpoint: thinker.layers.0.norm.bias, " in str(err.value)
    assert "thinker.layers.1.experts.2.up_proj.weight" in str(err.value)


def test_unexpected_tensors_are_listed(tmp_path):
    tensors = file_tensors()
    tensors["thinker.layers.0.extra.weight"] = torch.zeros(1)
    tensors["thinker.layers.1.experts.9.down_proj.weight"] = torch.zeros(HIDDEN, WIDTH)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"2 tensor\(s\) under 'thinker.' that the model does not have: "
        r"thinker.layers.0.extra.weight",
    ):
        load_weights(Toy(), tmp_path, "thinker.")


def test_shape_mismatch_names_tensor_expected_and_found(tmp_path):
    tensors = file_tensors()
    tensors["thinker.layers.1.proj.weight"] = torch.zeros(HIDDEN, HIDDEN + 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_weights(Toy(), tmp_path, "thinker.")
    assert (
        str(err.value)
        == "thinker.layers.1.proj.weight: expected shape (4, 4), found (4, 5) in model.safetensors"
    )


def test_expert_shape_mismatch(tmp_path):
    tensors = file_tensors()
    tensors["thinker.layers.0.experts.1.down_proj.weight"] = torch.zeros(WIDTH, HIDDEN)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"experts.1.down_proj.weight: expected shape \(4, 2\), found \(2, 4\)"
    ):
        load_weights(Toy(), tmp_path, "thinker.")


def test_corrupt_file_names_the_path(tmp_path):
    save_file(file_tensors(), str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:50])
    with pytest.raises(
        CheckpointError, match=rf"{tmp_path / 'model.safetensors'}: unreadable safetensors file"
    ):
        load_weights(Toy(), tmp_path, "thinker.")


def test_no_weights_at_all(tmp_path):
    with pytest.raises(CheckpointError, match=r"no model.safetensors or model.safetensors.index.json"):
        load_weights(Toy(), tmp_path, "thinker.")


class _Made(TorchDispatchMode):
    """Records the dtype and size of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self.made.append((tensor.dtype, tensor.numel()))
        return out


def test_random_weights_are_made_in_the_load_dtype_not_in_float32_first():
    # the released Thinker in float32 (~127 GB) fits no 80 GB card, even for a moment
    options = LoadOptions(dtype=torch.bfloat16, device="cpu", load_format="dummy")
    with _Made() as mode:
        model = load_model(Toy, "unused", "", options)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.layers[0].freqs.dtype == torch.float32
    assert not [numel for dtype, numel in mode.made if dtype == torch.float32 and numel >= HIDDEN * HIDDEN]


def test_a_meta_module_loads_without_a_float32_copy_of_its_weights(tmp_path):
    released = {name: tensor.to(torch.bfloat16) for name, tensor in file_tensors().items()}  # as released
    save_file(released, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Toy()
    with _Made() as mode:
        load_weights(model, tmp_path, "thinker.", dtype=torch.bfloat16, device="cpu")
    assert model.layers[1].experts.w13.dtype == torch.bfloat16
    assert not [numel for dtype, numel in mode.made if dtype == torch.float32 and numel >= HIDDEN * HIDDEN]


def test_random_weights_keep_a_parameter_shared_by_two_modules_shared():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, HIDDEN)
            self.head = nn.Linear(HIDDEN, 8, bias=False)
            self.head.weight = self.embed.weight

    options = LoadOptions(dtype=torch.bfloat16, device="cpu", load_format="dummy")
    model = load_model(Tied, "unused", "", options)
    assert model.head.weight is model.embed.weight
    assert model.head.weight.dtype == torch.bfloat16
