"""The schema of the `engine:` section: the engine-wide settings and the `stages:` topology, one name each."""

from __future__ import annotations

from typing import Any, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from omnistage.config.flags import MOVED, flag_of
from omnistage.config.sections import KV_KEYS, STAGE_TITLES, SettingError, StageName, StagesSection
from omnistage.config.settings import (
    Code2WavSettings,
    CodePredictorSettings,
    DecoderSettings,
    EncodersSettings,
    EngineSettings,
    StageSettings,
    engine_settings,
    resolve,
)

EMBEDDED_MAX_TOKENS_DEFAULT = 256


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="checkpoint directory (default: the embedded tiny random-weight model)"
    )
    load_format: Literal["safetensors", "dummy"] = Field(
        "safetensors", description="dummy: random weights at the checkpoint's sizes, for benchmarks"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="every stage's device unless its own says otherwise; auto takes a GPU when there is one",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight and activation type; auto: bfloat16 on a GPU, float32 on a CPU"
    )
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    gpu_memory_limit_gib: float | None = Field(
        None, gt=0, description="cap on the GPU memory omnistage plans to use (default: the whole device)"
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="per-step token budget; a longer prefill runs in chunks"
    )
    max_model_len: int | None = Field(None, ge=1, description="context limit (default: the model's)")
    enforce_eager: bool = Field(
        False, description="no CUDA graphs, for every stage that does not say otherwise"
    )
    compile: bool = Field(
        True,
        description="torch.compile the decoder layers and the vision tower's blocks on a GPU (fuses the glue "
        "kernels)",
    )
    flash_prefill: bool = Field(
        True,
        description="on a GPU, an eager step's prompt chunks over long contexts (4,096 keys and more) through "
        "torch's FlashAttention over their keys gathered from the pages, where this torch has it; the paged kernel "
        "otherwise, and in the CUDA graphs (README)",
    )
    long_prefill_kernel: Literal["flash", "triton"] = Field(
        "flash",
        description="with flash_prefill, the kernel for those chunks' keys gathered from the pages: flash torch's "
        "varlen FlashAttention, triton omnistage's (kernels/long_attention.py: no plan per shape, Hopper's "
        "warpgroup tensor cores); either is checked at start against plain attention (README)",
    )
    overlap_stages: bool = Field(
        False,
        description="on a GPU, run the Thinker's decode steps beside the speech stages' (a thread and stream of "
        "its own); off by default: on an H200 a process so run stalled for minutes (README)",
    )
    decode_ahead: bool = Field(
        True,
        description="launch the next decode step before the last one's tokens are read back, so that the host's "
        "work per step runs while the GPU computes (the Thinker's steps beside the speech stages' run without)",
    )
    prefix_caching: bool = Field(
        True,
        description="share the KV pages of prompts' common full-page prefixes (ids, positions and media rows "
        "alike) between requests and turns, kept in the Thinker's and the Talker's pools until their pages are "
        'needed (README, "Prefix caching")',
    )
    admission_window_ms: float = Field(
        50.0,
        ge=0,
        description="an idle engine holds a request while its server is still preparing others that came with "
        "it, up to this long, so that the burst is encoded and prefilled together (0: never held)",
    )
    admission_hold_steps: int = Field(
        0,
        ge=0,
        description="a busy engine holds its arrivals up to this many steps, then admits them together: their "
        "media encoded in one pass, their prompts in one step beside the decode rows, so that fewer steps pay "
        "for prompt rows (0: admitted at the next step)",
    )
    stream_interval: int | None = Field(
        None,
        ge=1,
        description="a streamed reply's output every N tokens (its first and its last at once, the deltas "
        "between joined): fewer, larger chunks, and less host work a step under load; default 1, 4 for "
        "Qwen3-ASR; a spoken reply's text always goes to the Talker token by token",
    )
    moe_kernel: Literal["auto", "grouped_mm", "triton"] = Field(
        "auto",
        description="GPU MoE kernel: auto and triton take our Triton kernel at every batch (its tiles by the "
        "rows an expert gets), grouped_mm torch's grouped GEMMs",
    )
    seed: int = Field(0, description="seed of the random weights of load_format dummy")
    speech: bool = Field(
        True, description="load the Talker, code predictor and Code2Wav when the checkpoint has them"
    )
    max_num_speaking: int | None = Field(
        None,
        ge=1,
        description="most speaking requests in flight; more wait their turn in arrival order, counted by "
        "--max-queue (text requests never wait for them); default: the Talker's max_batch on a GPU, "
        "eagerly at most Code2Wav's max_streams",
    )
    voice_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="more names for the checkpoint's speakers, name: speaker (alloy=chelsie), on top of the "
        "default table of OpenAI's 13 voice names (README, Speech); a name of a speaker the checkpoint lacks "
        "stops the start (default: the table alone)",
    )
    max_tokens_default: int | None = Field(
        None,
        ge=1,
        description="max_tokens of a request that gives none; default: up to the context, or "
        f"{EMBEDDED_MAX_TOKENS_DEFAULT} on the embedded tiny model",
    )
    stages: StagesSection = Field(
        default_factory=StagesSection, description="the topology: each stage's device, pool, batch and graphs"
    )
    _source: str | None = PrivateAttr(None)  # the YAML file, for the messages of pipeline/topology.py

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """A key that now lives under `stages:` names its place."""
        for key in MOVED.keys() & (data.keys() if isinstance(data, dict) else set()):
            flag = flag_of(MOVED[key])
            also = f" (the command line's {flag} sets it too)" if flag else ""
            raise SettingError(key, f"this setting is {MOVED[key]} now{also}: give it there")
        return data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        for name in ("thinker", "talker"):
            section = getattr(self.stages, name)
            given = [f"stages.{name}.{key}" for key in KV_KEYS if getattr(section, key) is not None]
            if len(given) > 1:
                raise SettingError(
                    given[1],
                    f"the {STAGE_TITLES[name]}'s KV pool is already sized by {given[0]}: give one of "
                    f"stages.{name}.num_kv_pages, kv_cache_memory_gib or kv_share",
                )
        self._check_graph_bounds()
        if self.model is None and "max_tokens_default" not in self.model_fields_set:
            # The embedded model's random weights rarely pick the end token: answers stop promptly.
            self.max_tokens_default = EMBEDDED_MAX_TOKENS_DEFAULT
        return self

    def _check_graph_bounds(self) -> None:
        """Graph sizes a stage asks for explicitly must be sizes its batches can reach."""
        tokens = ("max_num_batched_tokens", self.max_num_batched_tokens)
        limits = {
            "thinker.graphs": ("stages.thinker.max_batch", self.stage("thinker").max_batch),
            "thinker.prefill_graphs": tokens,
            "talker.graphs": ("stages.talker.max_batch", self.stage("talker").max_batch),
            "talker.prefill_graphs": (
                "stages.talker.max_num_batched_tokens",
                self.stage("talker").max_num_batched_tokens,
            ),
            "code_predictor.graphs": (
                "stages.code_predictor.max_batch",
                self.stage("code_predictor").max_batch,
            ),
            "code2wav.graphs": ("stages.code2wav.max_streams", self.stage("code2wav").max_streams),
        }
        for path, (limit_key, limit) in limits.items():
            stage, field = path.split(".")
            graphs = getattr(getattr(self.stages, stage), field)
            if graphs is not None and graphs.top is not None and graphs.top > limit:
                raise SettingError(
                    f"stages.{path}.{graphs.top_key}",
                    f"{graphs.top} is above {limit_key} ({limit}), which no step exceeds: "
                    f"lower it to {limit} or raise {limit_key}",
                )

    @property
    def source(self) -> str | None:
        """The YAML file this config was read from, if any."""
        return self._source

    def device_of(self, name: StageName) -> tuple[str, str]:
        """A stage's device and the key that sets it (the stage's own, `device`, or the stage it follows)."""
        own = getattr(self.stages, name).device
        if own is not None:
            return own, f"stages.{name}.device"
        if name == "thinker":
            return self.device, "device"
        if name in ("encoders", "talker"):
            return self.device_of("thinker")
        return self.device_of("talker")

    def with_stage(self, name: StageName, **values: Any) -> EngineConfig:
        """A copy with `values` set in the stage's section (as the stage's defaults a family chooses)."""
        section = getattr(self.stages, name).model_copy(update=values)
        return self.model_copy(update={"stages": self.stages.model_copy(update={name: section})})

    @overload
    def stage(self, name: Literal["thinker", "talker"]) -> DecoderSettings: ...
    @overload
    def stage(self, name: Literal["encoders"]) -> EncodersSettings: ...
    @overload
    def stage(self, name: Literal["code_predictor"]) -> CodePredictorSettings: ...
    @overload
    def stage(self, name: Literal["code2wav"]) -> Code2WavSettings: ...

    def stage(self, name: StageName) -> StageSettings:
        """One stage's settings with every default resolved (`settings.resolve`)."""
        return resolve(self, name)

    def engine_settings(self) -> EngineSettings:
        """The engine-wide settings a stage reads beside its own section (`settings.engine_settings`)."""
        return engine_settings(self)
