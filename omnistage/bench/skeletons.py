"""Checkpoint directories at a released model's sizes with no weights, for `--load-format dummy`: random weights
at the real shapes, for the benches and GPU tests that time the engine without a download."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

# --load-format dummy: which released model's sizes (the configs packaged in omnistage/data)
SKELETONS = {
    "qwen3-omni": None,
    "qwen3-asr-1.7b": "qwen3_asr_1p7b.config.json",
    "qwen3-asr-0.6b": "qwen3_asr_0p6b.config.json",
}


def released_skeleton(name: str = "qwen3-omni") -> Path:
    """A checkpoint directory at a released model's sizes with no weights, for `--load-format dummy`."""
    directory = Path(tempfile.mkdtemp(prefix="omnistage-released-"))
    skeleton = SKELETONS[name]
    if skeleton is not None:
        from omnistage.models.qwen3_asr.tiny import released_skeleton as asr_skeleton

        return asr_skeleton(directory, skeleton)
    from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG, released_config
    from omnistage.models.qwen3_omni.tokenizer import write_tokenizer_files

    (directory / "config.json").write_text(json.dumps(released_config()))
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    write_tokenizer_files(directory)
    return directory
