"""Each stage's settings with every default resolved: what `EngineConfig.stage(name)` hands a stage, and the
engine-wide ones a stage reads beside them (`EngineConfig.engine_settings()`).

A stage's own key wins, else the stage it follows: the encoders follow the Thinker, the code predictor and
Code2Wav the Talker, and the Talker the Thinker. `device` and `enforce_eager` at the top of the config are
every stage's default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from omnistage.config.sections import GraphsSection, StageName

if TYPE_CHECKING:
    from omnistage.config.engine import EngineConfig

MAX_BATCH = 64  # the Thinker's, which the speech stages follow
MAX_GRAPH_BATCH = 128  # the Thinker's largest decode graph, at most its max_batch
MAX_PREFILL_GRAPH_TOKENS = 2048  # the Thinker's largest prefill graph, at most max_num_batched_tokens
MAX_STREAMS = 16  # Code2Wav's
# The Talker's least default step budget: a 30 s video's 22k-row Talker prompt in 3 steps rather than 11, its first
# packet sooner (benchmarks/RESULTS.md, "The Talker's own step budget"); the steps' peak stays under the floor's
# largest phase.
TALKER_MIN_BATCHED_TOKENS = 8192


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
class StageSettings:
    device: str  # auto, cpu, cuda or cuda:N (resolve it with the machine)
    enforce_eager: bool


@dataclass(frozen=True)
class DecoderSettings(StageSettings):
    """An autoregressive stage's: the Thinker's or the Talker's."""

    max_batch: int
    kv: KvSize
    graphs: Graphs  # decode batch sizes
    prefill_graphs: Graphs  # prefill step sizes, tokens
    max_num_batched_tokens: int  # its per-step budget, a long prompt's chunk


@dataclass(frozen=True)
class EncodersSettings(StageSettings):
    audio_graphs: Graphs  # windows per call
    vision_graphs: Graphs  # patches per call
    cache_bytes: int  # host memory keeping clips' rows (0: none)
    rows_bytes: int  # device memory for encoder rows not yet prefilled (at least the largest request's)


@dataclass(frozen=True)
class CodePredictorSettings(StageSettings):
    max_batch: int  # frames per call
    graphs: Graphs  # frame batch sizes


@dataclass(frozen=True)
class Code2WavSettings(StageSettings):
    max_streams: int
    first_chunk: int
    chunk: int
    graphs: Graphs  # streams per call, for each chunk size


@dataclass(frozen=True)
class EngineSettings:
    """The engine-wide settings a stage reads beside its own section (`EngineConfig.engine_settings()`)."""

    page_size: int  # tokens per KV page
    max_num_batched_tokens: int
    max_model_len: int | None  # None: the model's
    enforce_eager: bool  # the engine's, which a stage's own section may override
    compile: bool
    decode_ahead: bool
    prefix_caching: bool  # the text stages' (the Thinker's, Qwen3-ASR's decoder's) and the Talker's
    moe_kernel: str
    max_tokens_default: int | None
    stream_interval: int  # a streamed reply's tokens per output


def engine_settings(config: EngineConfig) -> EngineSettings:
    """`config`'s engine-wide settings that a stage reads: each field is the config's key of its name (an
    unset stream interval is 1)."""
    values = {f.name: getattr(config, f.name) for f in fields(EngineSettings)}
    return EngineSettings(**values | {"stream_interval": config.stream_interval or 1})


def resolve(config: EngineConfig, name: StageName) -> StageSettings:
    """One stage's settings from `config`, every default resolved."""
    s = config.stages
    section = getattr(s, name)
    eager = config.enforce_eager if section.enforce_eager is None else section.enforce_eager
    common: dict[str, Any] = {"device": config.device_of(name)[0], "enforce_eager": eager}

    def graphs(given: GraphsSection | None, default_max: int | None) -> Graphs:
        if given is not None and given.buckets is not None:
            return Graphs(eager, tuple(given.buckets))
        return Graphs(eager, max=given.max if given is not None and given.max is not None else default_max)

    thinker_batch = s.thinker.max_batch or MAX_BATCH
    talker_batch = s.talker.max_batch or thinker_batch
    budget = config.max_num_batched_tokens
    if name == "thinker":
        batch, decode_max = thinker_batch, min(MAX_GRAPH_BATCH, thinker_batch)
        prefill = graphs(section.prefill_graphs, min(MAX_PREFILL_GRAPH_TOKENS, budget))
    elif name == "talker":
        batch, decode_max = talker_batch, talker_batch
        budget = s.talker.max_num_batched_tokens or max(budget, TALKER_MIN_BATCHED_TOKENS)
        follows = config.stage("thinker").prefill_graphs  # unless the Talker is given its own sizes
        if section.prefill_graphs is not None:
            prefill = graphs(section.prefill_graphs, None)
        elif follows.buckets is not None:  # those its own budget's steps reach
            prefill = Graphs(eager, tuple(b for b in follows.buckets if b <= budget))
        else:
            prefill = Graphs(eager, max=None if follows.max is None else min(follows.max, budget))
    if name in ("thinker", "talker"):
        return DecoderSettings(
            **common,
            max_batch=batch,
            kv=KvSize(section.num_kv_pages, section.kv_cache_memory_gib, section.kv_share),
            graphs=graphs(section.graphs, decode_max),
            prefill_graphs=prefill,
            max_num_batched_tokens=budget,
        )
    if name == "encoders":
        return EncodersSettings(
            **common,
            audio_graphs=graphs(section.audio_graphs, None),
            vision_graphs=graphs(section.vision_graphs, None),
            cache_bytes=section.cache_mib << 20,
            rows_bytes=section.rows_mib << 20,
        )
    if name == "code_predictor":
        frames = section.max_batch or talker_batch
        return CodePredictorSettings(**common, max_batch=frames, graphs=graphs(section.graphs, frames))
    streams = section.max_streams or MAX_STREAMS
    return Code2WavSettings(
        **common,
        max_streams=streams,
        first_chunk=section.first_chunk,
        chunk=section.chunk,
        graphs=graphs(section.graphs, streams),
    )
