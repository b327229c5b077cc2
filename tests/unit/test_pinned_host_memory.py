"""Importing omnistage asks torch to pin host memory by registering it from 8 threads (RESULTS.md, "Pinning a
video's rows"), keeping the allocator settings the environment gives, and leaving any pinned_ one given alone."""

import os
import subprocess
import sys

import pytest

import omnistage


@pytest.mark.parametrize(
    ("given", "seen"),
    [
        (None, omnistage.PINNED_HOST_MEMORY),
        ("expandable_segments:True", "expandable_segments:True," + omnistage.PINNED_HOST_MEMORY),
        ("pinned_num_register_threads:2", "pinned_num_register_threads:2"),
    ],
)
def test_the_allocator_setting_of_a_process_importing_omnistage(given, seen):
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if given is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = given
    code = "import omnistage, os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == seen
