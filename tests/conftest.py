import fcntl
import os
import shutil
from pathlib import Path

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


# A directory the pytest processes of one `make test` share (the Makefile makes it and removes it after): each
# tiny checkpoint is written once per run, not once per process. Without it, once per session as before.
CHECKPOINTS = "OMNISTAGE_TEST_CHECKPOINTS"


def tiny(tmp_path_factory, name: str, variant: str = "instruct") -> Path:
    """The tiny checkpoint of `variant` (seed 0): made in the run's shared directory, or in this session's."""
    shared = os.environ.get(CHECKPOINTS)
    if not shared:
        return make_tiny(tmp_path_factory.mktemp(name), variant=variant)
    target = Path(shared) / name
    # processes running at once take turns: the first makes it, the others find it made
    with open(Path(shared) / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            # made beside its place and renamed, so a process that stops midway leaves no half checkpoint
            made = make_tiny(tmp_path_factory.mktemp(f"{name}-making"), variant=variant)
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(made, target)
    return target


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """One tiny random Qwen3-Omni checkpoint (seed 0) shared by the whole test session; treat it as read-only."""
    return tiny(tmp_path_factory, "tiny-qwen3-omni")


@pytest.fixture(scope="session")
def tiny_tools_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint with a chat template that renders tools (tools_template.py); read-only."""
    return with_tools_template(tiny_checkpoint, tmp_path_factory.mktemp("tiny-tools-template"))


@pytest.fixture(scope="session")
def tiny_thinking_checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni-Thinking checkpoint (seed 0): the Thinker alone; treat it as read-only."""
    return tiny(tmp_path_factory, "tiny-qwen3-omni-thinking", variant="thinking")


@pytest.fixture(scope="session")
def tiny_captioner_checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni-Captioner checkpoint (seed 0): the Thinker alone; treat it as read-only."""
    return tiny(tmp_path_factory, "tiny-qwen3-omni-captioner", variant="captioner")
