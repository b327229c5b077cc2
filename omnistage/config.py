"""Engine settings: one strict pydantic schema for the YAML file, the CLI and the offline `LLM` kwargs.

An unknown or mistyped key fails at start with its path and the reason. The `stages:` section is the
topology: where each stage (Thinker, encoders, Talker, code predictor, Code2Wav) runs, its KV pool, its
batch limit, its CUDA graph sizes and its workspaces. `EngineConfig.stage(name)` gives one stage's settings
with every default resolved; `pipeline/topology.py` checks them against the machine at start.

The flat keys that predate the section (`num_kv_pages`, `max_graph_batch`, `speech_device`, ...) are the
same settings under their old names (`_ALIASES`): either may be given, and a stage's value is copied onto
its flat name so that readers of the flat name see it too. `device` and `enforce_eager` are every stage's
default, which a stage's own key overrides.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, overload

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from omnistage.errors import ConfigError

EMBEDDED_MAX_TOKENS_DEFAULT = 256

StageName = Literal["thinker", "encoders", "talker", "code_predictor", "code2wav"]
STAGES: tuple[StageName, ...] = typing.get_args(StageName)
_DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
_KV_KEYS = ("num_kv_pages", "kv_cache_memory_gib", "kv_share")

# flat key: the stage key (under `stages.`) that is the same setting
_ALIASES: dict[str, str] = {
    "num_kv_pages": "thinker.num_kv_pages",
    "kv_cache_memory_gib": "thinker.kv_cache_memory_gib",
    "max_num_seqs": "thinker.max_batch",
    "max_graph_batch": "thinker.graphs.max",
    "max_prefill_graph_tokens": "thinker.prefill_graphs.max",
    "talker_kv_cache_memory_gib": "talker.kv_cache_memory_gib",
    "code2wav_max_batch": "code2wav.max_streams",
    "speech_device": "talker.device",
}
_FLAT_NAME = {path: flat for flat, path in _ALIASES.items()}
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GraphsSection(_Strict):
    """The sizes a stage captures in CUDA graphs: `buckets` as listed, or its ladder of sizes up to `max`."""

    buckets: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="the sizes to capture, ascending; [] captures none"
    )
    max: int | None = Field(None, ge=1, description="the largest size of the stage's own ladder")

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
        return max(self.buckets, default=None) if self.buckets is not None else self.max

    @property
    def top_key(self) -> str:
        return "buckets" if self.buckets is not None else "max"


class _StageSection(_Strict):
    device: str | None = Field(
        None, pattern=_DEVICE_PATTERN, description="cpu, cuda (the current GPU) or cuda:N"
    )
    enforce_eager: bool | None = Field(
        None, description="no CUDA graphs; default: the engine's enforce_eager"
    )


class _KvSection(_Strict):
    num_kv_pages: int | None = Field(None, ge=1, description="a fixed pool of this many pages")
    kv_cache_memory_gib: float | None = Field(None, gt=0, description="a pool of this much memory")
    kv_share: float | None = Field(
        None, gt=0, le=1, description="this fraction of the memory the plan leaves for KV pages on the device"
    )


class ThinkerSection(_StageSection, _KvSection):
    max_batch: int | None = Field(None, ge=1, description="most sequences running at once (max_num_seqs)")
    graphs: GraphsSection | None = Field(None, description="decode batch sizes (max_graph_batch)")
    prefill_graphs: GraphsSection | None = Field(
        None, description="prefill step sizes in tokens (max_prefill_graph_tokens)"
    )


class EncodersSection(_StageSection):
    audio_graphs: GraphsSection | None = Field(None, description="windows per audio tower call")
    vision_graphs: GraphsSection | None = Field(None, description="patches per vision tower call")


class TalkerSection(_StageSection, _KvSection):
    max_batch: int | None = Field(None, ge=1, description="most Talker sequences at once")
    graphs: GraphsSection | None = Field(None, description="decode batch sizes")
    prefill_graphs: GraphsSection | None = Field(
        None, description="prefill step sizes in tokens (default: the Thinker's)"
    )


class CodePredictorSection(_StageSection):
    max_batch: int | None = Field(None, ge=1, description="most frames in one call")
    graphs: GraphsSection | None = Field(None, description="frame batch sizes")


class Code2WavSection(_StageSection):
    max_streams: int | None = Field(
        None, ge=1, description="most audio streams in one call (code2wav_max_batch)"
    )
    first_chunk: int = Field(
        2, ge=1, description="frames of a stream's first chunk (the first packet's latency)"
    )
    chunk: int = Field(25, ge=1, description="frames of each later chunk")
    graphs: GraphsSection | None = Field(None, description="streams per call, captured for each chunk size")


class StagesSection(_Strict):
    thinker: ThinkerSection = Field(default_factory=ThinkerSection)
    encoders: EncodersSection = Field(default_factory=EncodersSection)
    talker: TalkerSection = Field(default_factory=TalkerSection)
    code_predictor: CodePredictorSection = Field(default_factory=CodePredictorSection)
    code2wav: Code2WavSection = Field(default_factory=Code2WavSection)


@dataclass(frozen=True)
class Graphs:
    """A stage's CUDA graph sizes as configured; `sizes` turns them into the list to capture."""

    eager: bool
    buckets: tuple[int, ...] | None = None
    max: int | None = None  # None: the stage's own default bound

    def sizes(self, ladder: Callable[[int], list[int]], default_max: int | None = None) -> list[int]:
        """The sizes to capture: none when eager, the listed buckets, else `ladder` up to `max` (or
        `default_max` where the config gives no bound)."""
        if self.eager:
            return []
        if self.buckets is not None:
            return list(self.buckets)
        top = self.max if self.max is not None else default_max
        return ladder(top) if top else []


@dataclass(frozen=True)
class KvSize:
    """How a stage's KV pool is sized: at most one is set; none: the stage's default."""

    pages: int | None = None
    gib: float | None = None
    share: float | None = None


@dataclass(frozen=True)
class Stage:
    device: str  # auto, cpu, cuda or cuda:N (resolve it with the machine)
    enforce_eager: bool


@dataclass(frozen=True)
class ThinkerStage(Stage):
    max_batch: int
    kv: KvSize
    graphs: Graphs  # decode batch sizes
    prefill_graphs: Graphs  # prefill step sizes, tokens


@dataclass(frozen=True)
class EncodersStage(Stage):
    audio_graphs: Graphs  # windows per call
    vision_graphs: Graphs  # patches per call


@dataclass(frozen=True)
class TalkerStage(Stage):
    max_batch: int
    kv: KvSize
    graphs: Graphs  # decode batch sizes
    prefill_graphs: Graphs  # prefill step sizes, tokens


@dataclass(frozen=True)
class CodePredictorStage(Stage):
    max_batch: int  # frames per call
    graphs: Graphs  # frame batch sizes


@dataclass(frozen=True)
class Code2WavStage(Stage):
    max_streams: int
    first_chunk: int
    chunk: int
    graphs: Graphs  # streams per call, for each chunk size


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
    admission_window_ms: float = Field(
        50.0,
        ge=0,
        description="an idle engine holds a request while its server is still preparing others that came with "
        "it, up to this long, so that the burst is encoded and prefilled together (0: never held)",
    )
    moe_kernel: Literal["auto", "grouped_mm", "triton"] = Field(
        "auto", description="GPU MoE kernel: auto takes Triton for decode-sized batches, grouped GEMMs above"
    )
    max_graph_batch: int = Field(
        128, ge=1, description="largest decode batch captured in a CUDA graph (the plan may capture fewer)"
    )
    # a step of 547 to 2,048 rows of Qwen3-ASR 0.6B prompts took 37-86 ms eagerly on the H200 where one of
    # 188-488 rows replayed in 7-12 ms (benchmarks/RESULTS.md, "Where a loaded step's time goes")
    max_prefill_graph_tokens: int = Field(
        2048,
        ge=0,
        description="largest prefill step (tokens) captured in a CUDA graph, at most max_num_batched_tokens "
        "(0: none)",
    )
    seed: int = Field(0, description="seed of the random weights of load_format dummy")
    speech: bool = Field(
        True, description="load the Talker, code predictor and Code2Wav when the checkpoint has them"
    )
    talker_kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="memory for the Talker's KV pages; default: 0.25 GiB on CPU, 2 GiB on a GPU"
    )
    code2wav_max_batch: int = Field(16, ge=1, description="most audio streams in one Code2Wav decode call")
    max_num_speaking: int | None = Field(
        None,
        ge=1,
        description="most speaking requests in flight; more wait their turn in arrival order, counted by "
        "--max-queue (text requests never wait for them); default: the Talker's max_batch on a GPU, "
        "eagerly at most Code2Wav's max_streams",
    )
    speech_device: str | None = Field(
        None,
        pattern=_DEVICE_PATTERN,
        description="where the Talker, code predictor and Code2Wav run (e.g. cuda:1: the two-GPU topology); "
        "default: the Thinker's device",
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

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        for flat, path in _ALIASES.items():
            value = _lookup(self.stages, path)
            if value is None:
                continue
            if flat in self.model_fields_set and getattr(self, flat) != value:
                raise SettingError(
                    f"stages.{path}",
                    f"{value!r}, but {flat} is {getattr(self, flat)!r}: they are one setting under two "
                    "names, give it once",
                )
            setattr(self, flat, value)
        for name in ("thinker", "talker"):
            given = [key for key, value in self.kv_sizing(name) if value is not None]
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
        s = self.stages
        thinker, talker = self.stage("thinker"), self.stage("talker")
        limits = [
            (
                "thinker.graphs",
                s.thinker.graphs,
                thinker.max_batch,
                "stages.thinker.max_batch" if s.thinker.max_batch else "max_num_seqs",
            ),
            (
                "thinker.prefill_graphs",
                s.thinker.prefill_graphs,
                self.max_num_batched_tokens,
                "max_num_batched_tokens",
            ),
            ("talker.graphs", s.talker.graphs, talker.max_batch, "stages.talker.max_batch"),
            (
                "talker.prefill_graphs",
                s.talker.prefill_graphs,
                self.max_num_batched_tokens,
                "max_num_batched_tokens",
            ),
            (
                "code_predictor.graphs",
                s.code_predictor.graphs,
                self.stage("code_predictor").max_batch,
                "stages.code_predictor.max_batch",
            ),
            (
                "code2wav.graphs",
                s.code2wav.graphs,
                self.stage("code2wav").max_streams,
                "stages.code2wav.max_streams",
            ),
        ]
        for path, graphs, limit, limit_key in limits:
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
        """A stage's device and the key that sets it (a stage's own, a flat key, or the stage it follows)."""
        own = getattr(self.stages, name).device
        if own is not None:
            return own, f"stages.{name}.device"
        if name == "thinker":
            return self.device, "device"
        if name == "encoders":
            return self.device_of("thinker")
        if name == "talker":
            if self.speech_device is not None:
                return self.speech_device, "speech_device"
            return self.device_of("thinker")
        return self.device_of("talker")

    def kv_sizing(self, name: str) -> list[tuple[str, Any]]:
        """The (pages, GiB, share) of the Thinker's or the Talker's pool, each with the key it is written under:
        the stage's own, else its flat name (the values typed as `KvSize`'s fields)."""
        section = getattr(self.stages, name)
        out = []
        for key in _KV_KEYS:
            flat = _FLAT_NAME.get(f"{name}.{key}")
            if getattr(section, key) is None and flat is not None:
                out.append((flat, getattr(self, flat)))
            else:
                out.append((f"stages.{name}.{key}", getattr(section, key)))
        return out

    @overload
    def stage(self, name: Literal["thinker"]) -> ThinkerStage: ...
    @overload
    def stage(self, name: Literal["encoders"]) -> EncodersStage: ...
    @overload
    def stage(self, name: Literal["talker"]) -> TalkerStage: ...
    @overload
    def stage(self, name: Literal["code_predictor"]) -> CodePredictorStage: ...
    @overload
    def stage(self, name: Literal["code2wav"]) -> Code2WavStage: ...

    def stage(self, name: StageName) -> Stage:
        """One stage's settings with every default resolved (a stage's key, else its flat key, else the
        stage it follows: the encoders follow the Thinker, the code predictor and Code2Wav the Talker)."""
        s = self.stages
        section = getattr(s, name)
        eager = self.enforce_eager if section.enforce_eager is None else section.enforce_eager
        common: dict[str, Any] = {"device": self.device_of(name)[0], "enforce_eager": eager}

        def graphs(given: GraphsSection | None, default_max: int | None) -> Graphs:
            if given is not None and given.buckets is not None:
                return Graphs(eager, tuple(given.buckets))
            return Graphs(
                eager, max=given.max if given is not None and given.max is not None else default_max
            )

        thinker_batch = s.thinker.max_batch or self.max_num_seqs
        talker_batch = s.talker.max_batch or thinker_batch
        if name == "thinker":
            prefill = min(self.max_prefill_graph_tokens, self.max_num_batched_tokens)
            return ThinkerStage(
                **common,
                max_batch=thinker_batch,
                kv=KvSize(*(v for _, v in self.kv_sizing("thinker"))),
                graphs=graphs(s.thinker.graphs, min(self.max_graph_batch, thinker_batch)),
                prefill_graphs=graphs(s.thinker.prefill_graphs, prefill or None),
            )
        if name == "encoders":
            return EncodersStage(
                **common,
                audio_graphs=graphs(s.encoders.audio_graphs, None),
                vision_graphs=graphs(s.encoders.vision_graphs, None),
            )
        if name == "talker":
            thinker_prefill = self.stage("thinker").prefill_graphs
            return TalkerStage(
                **common,
                max_batch=talker_batch,
                kv=KvSize(*(v for _, v in self.kv_sizing("talker"))),
                graphs=graphs(s.talker.graphs, talker_batch),
                prefill_graphs=(
                    graphs(s.talker.prefill_graphs, None)
                    if s.talker.prefill_graphs is not None
                    else Graphs(eager, thinker_prefill.buckets, thinker_prefill.max)
                ),
            )
        if name == "code_predictor":
            frames = s.code_predictor.max_batch or talker_batch
            return CodePredictorStage(
                **common, max_batch=frames, graphs=graphs(s.code_predictor.graphs, frames)
            )
        c2w = s.code2wav
        streams = c2w.max_streams or self.code2wav_max_batch
        return Code2WavStage(
            **common,
            max_streams=streams,
            first_chunk=c2w.first_chunk,
            chunk=c2w.chunk,
            graphs=graphs(c2w.graphs, streams),
        )


def _lookup(section: BaseModel, path: str) -> object:
    """The value at dotted `path` below `section`, or None where a section on the way is not given."""
    value: object = section
    for key in path.split("."):
        if value is None:
            return None
        value = getattr(value, key)
    return value


def _describe(exc: ValidationError, source: str, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        error = err.get("ctx", {}).get("error")
        if isinstance(error, SettingError):
            loc += [error.path] if error.path else []
            reason = error.reason
        path = ".".join(loc)
        lines.append(f"{source}: {prefix + path if path else '(top level)'}: {reason}")
    return "\n".join(lines)


def engine_config(source: str = "arguments", **values) -> EngineConfig:
    """An EngineConfig from keyword values, raising ConfigError that names each bad key."""
    try:
        return EngineConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def _replaced_by(key: str) -> list[str]:
    """The keys of a file (dotted paths below `engine:`) that a command-line value of `key` replaces."""
    if key == "device":
        return ["speech_device", *(f"stages.{s}.device" for s in STAGES)]
    if key == "enforce_eager":
        return [f"stages.{s}.enforce_eager" for s in STAGES]
    if key in _KV_KEYS[:2]:
        return list(_KV_KEYS[:2]) + [f"stages.thinker.{k}" for k in _KV_KEYS]
    return [f"stages.{_ALIASES[key]}"] if key in _ALIASES else []


def _drop(section: dict, path: str) -> None:
    *parents, last = path.split(".")
    for key in parents:
        child = section.get(key)
        if not isinstance(child, dict):
            return
        section = child
    section.pop(last, None)


def load_config(path: str | Path, **overrides) -> EngineConfig:
    """The YAML file's `engine:` section with CLI `overrides` (None values ignored) on top: a flag replaces
    the file's key and every stage key that is the same setting (`--device cpu` moves every stage)."""
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
        raise ConfigError(_describe(exc, str(path), prefix="engine.")) from None
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = copy.deepcopy(section)
    for key in given:
        for replaced in _replaced_by(key):
            _drop(merged, replaced)
    config = engine_config(str(path), **(merged | given))
    config._source = str(path)
    return config
