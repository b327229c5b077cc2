import pytest
import torch
from tools_template import with_tools_template

from omnistage.models.qwen3_omni.tiny import make_tiny

# A test marked slow starts an engine of its own on the GPU: past the suite's per-test timeout (pyproject's
# `timeout`), within this one.
SLOW_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
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


@pytest.fixture(scope="session")
def tiny_tools_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint with a chat template that renders tools (tools_template.py); read-only."""
    return with_tools_template(tiny_checkpoint, tmp_path_factory.mktemp("tiny-tools-template"))


@pytest.fixture(scope="session")
def tiny_thinking_checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni-Thinking checkpoint (seed 0): the Thinker alone; treat it as read-only."""
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-omni-thinking"), variant="thinking")


@pytest.fixture(scope="session")
def tiny_captioner_checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni-Captioner checkpoint (seed 0): the Thinker alone; treat it as read-only."""
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-omni-captioner"), variant="captioner")
