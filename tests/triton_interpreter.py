"""Triton kernels on the CPU: Triton's interpreter, in a child pytest.

Triton picks interpreted or compiled kernels when `triton.language` is first imported, so a test file of
kernels runs itself in a child pytest with TRITON_INTERPRET=1 set from its start; in the parent it is one
test that launches the child (a process with compiled kernels, e.g. the GPU tests, stays untouched).
"""

import os
import subprocess
import sys

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def run_in_interpreter(test_file: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def patch_interpreter() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns loop bounds into ints with
    int(array), which numpy >= 2.4 refuses for arrays of one dimension."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
