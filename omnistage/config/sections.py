"""The `stages:` section of the schema: one strict pydantic model per stage, each key written once."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StageName = Literal["thinker", "encoders", "talker", "code_predictor", "code2wav"]
STAGES: tuple[StageName, ...] = typing.get_args(StageName)
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
KV_KEYS = ("num_kv_pages", "kv_cache_memory_gib", "kv_share")
STAGE_TITLES = {
    "thinker": "Thinker",
    "encoders": "encoders",
    "talker": "Talker",
    "code_predictor": "code predictor",
    "code2wav": "Code2Wav",
}


class SettingError(ValueError):
    """A setting that breaks a rule, at `path` below the model that raises it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.reason = path, reason


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GraphsSection(Strict):
    """The sizes a stage captures in CUDA graphs: `buckets` as listed, or its ladder of sizes up to `max`."""

    buckets: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="the sizes to capture, ascending; [] captures none"
    )
    max: int | None = Field(None, ge=0, description="the largest size of the stage's own ladder (0: none)")

    @model_validator(mode="after")
    def _check(self) -> GraphsSection:
        if self.buckets is not None and self.max is not None:
            raise SettingError("", "give buckets or max, not both")
        if self.buckets is not None and self.buckets != sorted(set(self.buckets)):
            raise SettingError("buckets", f"{self.buckets}: list each size once, in ascending order")
        return self

    @property
    def top(self) -> int | None:
        """The largest size asked for (None: none asked for)."""
        return max(self.buckets, default=None) if self.buckets is not None else self.max or None

    @property
    def top_key(self) -> str:
        return "buckets" if self.buckets is not None else "max"


class _StageSection(Strict):
    device: str | None = Field(
        None, pattern=DEVICE_PATTERN, description="cpu, cuda (the current GPU) or cuda:N"
    )
    enforce_eager: bool | None = Field(
        None, description="no CUDA graphs; default: the engine's enforce_eager"
    )


class _KvSection(Strict):
    num_kv_pages: int | None = Field(
        None, ge=1, description="a fixed pool of this many pages (default: sized from memory)"
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description="a pool of this much memory (default: 0.25 GiB on a CPU; on a GPU all that the plan leaves "
        "for the Thinker, 2 GiB for the Talker)",
    )
    kv_share: float | None = Field(
        None, gt=0, le=1, description="this fraction of the memory the plan leaves for KV pages on the device"
    )


class ThinkerSection(_StageSection, _KvSection):
    max_batch: int | None = Field(None, ge=1, description="most sequences running at once (default: 64)")
    graphs: GraphsSection | None = Field(
        None, description="decode batch sizes captured in CUDA graphs (default: up to 128, at most max_batch)"
    )
    # a step of 547 to 2,048 rows of Qwen3-ASR 0.6B prompts took 37-86 ms eagerly on the H200 where one of
    # 188-488 rows replayed in 7-12 ms (benchmarks/RESULTS.md, "Where a loaded step's time goes")
    prefill_graphs: GraphsSection | None = Field(
        None,
        description="prefill step sizes (tokens) captured in CUDA graphs (default: up to 2048, at most "
        "max_num_batched_tokens)",
    )


class EncodersSection(_StageSection):
    audio_graphs: GraphsSection | None = Field(
        None,
        description="audio tower calls captured in CUDA graphs, in 8 s windows' worth of chunks (default: up to "
        "32, at most the longest clip's windows)",
    )
    vision_graphs: GraphsSection | None = Field(None, description="patches per vision tower call")
    cache_mib: int = Field(
        1024,
        ge=0,
        description="host memory (MiB) keeping the towers' rows of clips, images and videos seen before, so "
        "that one sent again gives the same rows without its tower (0: off; a 30 s 720p video's rows with their "
        "deepstack levels are ~350 MB)",
    )
    rows_mib: int = Field(
        512,
        ge=0,
        description="GPU memory (MiB) for the encoder rows of requests whose prefill has not passed them; "
        "requests with media wait unencoded beyond it. The plan keeps room for it, or for the largest media "
        "request's rows where they are more",
    )


class TalkerSection(_StageSection, _KvSection):
    device: str | None = Field(
        None,
        pattern=DEVICE_PATTERN,
        description="where the Talker (and the code predictor and Code2Wav after it) runs; cuda:1 is the "
        "two-GPU topology (default: the Thinker's device)",
    )
    max_batch: int | None = Field(
        None, ge=1, description="most Talker sequences at once (default: the Thinker's max_batch)"
    )
    graphs: GraphsSection | None = Field(None, description="decode batch sizes")
    prefill_graphs: GraphsSection | None = Field(
        None, description="prefill step sizes in tokens (default: the Thinker's)"
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="the Talker's per-step token budget: a long prompt (a 30 s video's 22k rows) is prefilled "
        "in chunks of at most this many rows (default: the engine's max_num_batched_tokens, at least 8192)",
    )


class CodePredictorSection(_StageSection):
    max_batch: int | None = Field(
        None, ge=1, description="most frames in one call (default: the Talker's max_batch)"
    )
    graphs: GraphsSection | None = Field(None, description="frame batch sizes")


class Code2WavSection(_StageSection):
    max_streams: int | None = Field(None, ge=1, description="most audio streams in one call (default: 16)")
    first_chunk: int = Field(
        2, ge=1, description="frames of a stream's first chunk (the first packet's latency)"
    )
    chunk: int = Field(25, ge=1, description="frames of each later chunk")
    graphs: GraphsSection | None = Field(None, description="streams per call, captured for each chunk size")


class StagesSection(Strict):
    thinker: ThinkerSection = Field(default_factory=ThinkerSection)
    encoders: EncodersSection = Field(default_factory=EncodersSection)
    talker: TalkerSection = Field(default_factory=TalkerSection)
    code_predictor: CodePredictorSection = Field(default_factory=CodePredictorSection)
    code2wav: Code2WavSection = Field(default_factory=Code2WavSection)
