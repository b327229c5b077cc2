"""omnistage: an inference server for thinker-talker omni models."""

from omnistage.engine.sampling import SamplingParams
from omnistage.llm import LLM
from omnistage.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
