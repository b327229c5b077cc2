"""omnistage: an inference server for thinker-talker omni models."""

from __future__ import annotations

import os
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnistage.llm import LLM
    from omnistage.outputs import CompletionOutput, RequestOutput
    from omnistage.request import SamplingParams

# Pinned host memory (the encoder cache's rows, the hand-off's media rows, every copy that must not wait) as
# torch's host allocator makes it by default, cudaHostAlloc, took 305 ms for 354 MiB on an H100 host, on the
# engine's thread; malloc'd, then registered by 8 threads, 57 ms (benchmarks/RESULTS.md, "Pinning a video's
# rows"). A small block still cost ~160 µs to register, once per new block: every new clip's rows the encoder
# cache keeps (Qwen3-ASR at c=128: 1.4 a step, "A 30 s video's first packet at 2.1 s"). So the first pinning
# also reserves 1 GiB (the encoder cache's default budget), registered once, and torch carves new blocks out
# of it until it is spent. Read when torch first pins memory: set here, before any of it, unless the
# environment names a pinned_ setting.
PINNED_HOST_MEMORY = (
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,pinned_reserve_segment_size_mb:1024"
)
_alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
if "pinned_" not in _alloc_conf:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, (_alloc_conf, PINNED_HOST_MEMORY)))

try:
    __version__ = version("omnistage")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The public names are loaded on first use: they pull in torch, which `omnistage --help` must not wait for.
_EXPORTS = {
    "LLM": "omnistage.llm",
    "SamplingParams": "omnistage.request",
    "RequestOutput": "omnistage.outputs",
    "CompletionOutput": "omnistage.outputs",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'omnistage' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
