"""omnistage: an inference server for thinker-talker omni models."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnistage.llm import LLM
    from omnistage.outputs import CompletionOutput, RequestOutput
    from omnistage.request import SamplingParams

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
