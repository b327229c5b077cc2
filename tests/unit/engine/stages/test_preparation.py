"""A decoder made ready to serve (`engine/stages/preparation.py`), and what a stage reads of any family's
decoder (`engine/stages/decoder.py`), on the tiny Thinker on the CPU."""

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.engine.stages.decoder import moe_routing, torch_module
from omnistage.engine.stages.preparation import prepare_decoder, set_moe_kernel
from omnistage.models.layers.moe import SparseMoeBlock
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.thinker import load_thinker


@pytest.fixture(scope="module")
def thinker(tiny_checkpoint):
    return load_thinker(tiny_checkpoint, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())


def kernels(model: torch.nn.Module) -> set[str]:
    return {m.kernel for m in model.modules() if isinstance(m, SparseMoeBlock)}


def test_every_moe_layer_takes_the_kernel(thinker):
    set_moe_kernel(thinker, "grouped_mm")
    assert kernels(thinker) == {"grouped_mm"}
    set_moe_kernel(thinker, "auto")
    assert kernels(thinker) == {"auto"}


def test_on_the_cpu_nothing_is_compiled_nor_adopted(thinker):
    assert prepare_decoder(thinker, torch.device("cpu"), "auto", compile=True) is False
    assert kernels(thinker) == {"auto"}
    assert all(layer._compiled_call_impl is None for layer in thinker.model.layers)  # torch's Module.compile


def test_a_decoder_is_a_torch_module_and_its_experts_are_read_where_it_has_them(thinker, tiny_checkpoint):
    assert torch_module(thinker) is thinker
    with pytest.raises(TypeError, match="torch module"):
        torch_module(object())  # type: ignore[arg-type]
    text = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker.text
    assert moe_routing(text) == (text.num_experts, text.num_experts_per_tok)
    assert moe_routing(object()) is None  # type: ignore[arg-type]
