import pytest
import torch

from omnistage.models.qwen3_omni.tiny import make_tiny


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """One tiny random Qwen3-Omni checkpoint (seed 0) shared by the whole test session; treat it as read-only."""
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-omni"))
