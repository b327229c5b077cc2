"""Engine settings: one strict pydantic schema for the YAML file, the CLI and the offline `LLM` kwargs.

An unknown or mistyped key fails at start with its path and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnistage.errors import ConfigError

EMBEDDED_MAX_TOKENS_DEFAULT = 256


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="checkpoint directory; None serves the embedded tiny model")
    load_format: Literal["safetensors", "dummy"] = Field(
        "safetensors", description="dummy: random weights at the checkpoint's sizes, for benchmarks"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    num_kv_pages: int | None = Field(None, ge=1, description="fixed pool size; default: planned from memory")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="memory for KV pages; default: 0.25 GiB on CPU, all that is left on a GPU"
    )
    gpu_memory_limit_gib: float | None = Field(None, gt=0, description="cap on what omnistage plans to use")
    max_num_seqs: int = Field(64, ge=1, description="most sequences running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="per-step token budget (chunked prefill)")
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: the model's")
    enforce_eager: bool = Field(False, description="no CUDA graphs")
    compile: bool = Field(
        True, description="torch.compile the decoder layers on a GPU (fuses the glue kernels)"
    )
    moe_kernel: Literal["auto", "grouped_mm", "triton"] = Field(
        "auto", description="GPU MoE kernel: auto takes Triton for decode-sized batches, grouped GEMMs above"
    )
    max_graph_batch: int = Field(64, ge=1, description="largest decode batch captured in a CUDA graph")
    max_prefill_graph_tokens: int = Field(
        512, ge=0, description="largest one-sequence prefill chunk captured in a CUDA graph (0: none)"
    )
    seed: int = Field(0, description="seed of the random weights of load_format dummy")
    speech: bool = Field(
        True, description="load the Talker, code predictor and Code2Wav when the checkpoint has them"
    )
    talker_kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="memory for the Talker's KV pages; default: 0.25 GiB on CPU, 2 GiB on a GPU"
    )
    code2wav_max_batch: int = Field(16, ge=1, description="most audio streams in one Code2Wav decode call")
    speech_device: str | None = Field(
        None,
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="where the Talker, code predictor and Code2Wav run (e.g. cuda:1: the two-GPU topology); "
        "default: the Thinker's device",
    )
    max_tokens_default: int | None = Field(
        None,
        ge=1,
        description="max_tokens of a request that gives none; default: up to the context, or "
        f"{EMBEDDED_MAX_TOKENS_DEFAULT} on the embedded tiny model",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_kv_pages is not None and self.kv_cache_memory_gib is not None:
            raise ValueError("give num_kv_pages or kv_cache_memory_gib, not both")
        if self.model is None and "max_tokens_default" not in self.model_fields_set:
            # The embedded model's random weights rarely pick the end token: answers stop promptly.
            self.max_tokens_default = EMBEDDED_MAX_TOKENS_DEFAULT
        return self


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{source}: {path}: {reason}")
    return "\n".join(lines)


def engine_config(source: str = "arguments", **values) -> EngineConfig:
    """An EngineConfig from keyword values, raising ConfigError that names each bad key."""
    try:
        return EngineConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: str | Path, **overrides) -> EngineConfig:
    """The YAML file's `engine:` section with CLI `overrides` (None values ignored) on top."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(data) - {"engine"})
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]}: unknown key (expected 'engine')")
    section = data.get("engine") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: engine: expected a mapping")
    try:
        EngineConfig(**section)
    except ValidationError as exc:
        described = _describe(exc, str(path))
        raise ConfigError(described.replace(f"{path}: ", f"{path}: engine.")) from None
    return engine_config(str(path), **(section | {k: v for k, v in overrides.items() if v is not None}))
