"""Qwen3-Omni's speech stages on their device: the Talker (a RowStage over its paged KV), the code
predictor (a FrameStage over `FrameGraphs`) and Code2Wav (a Code2WavStage over `Code2WavGraphs`, which
`Code2WavStreamer` streams through). Loaded here; each measures what it needs of its device's plan and takes
its grant as the `Stage` protocol says. The pipeline (`qwen3_omni.py`) hands each speaking request's text rows
and frames across them.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from omnistage.config import EngineConfig
from omnistage.engine.attention import backend_for
from omnistage.engine.buckets import decode_buckets, prefill_buckets
from omnistage.engine.devices import resolve_device
from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.engine.graphs.frames import FrameGraphs
from omnistage.engine.memory.plan import GiB, KVPool, MemoryPlan, StageMemory, least_pages
from omnistage.engine.stages.base import Stage
from omnistage.engine.stages.code2wav import Code2WavStage
from omnistage.engine.stages.frames import FrameStage
from omnistage.engine.stages.row_runner import RowRunner
from omnistage.engine.stages.rows import RowStage
from omnistage.models.layers.linear import adopt_gemv
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.code2wav import load_code2wav
from omnistage.models.qwen3_omni.code2wav_convs import adopt_polyphase
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder, Code2WavStreamer
from omnistage.models.qwen3_omni.code_predictor import load_code_predictor
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.models.qwen3_omni.talker_input import SpeechTokens

log = logging.getLogger(__name__)

_CPU_TALKER_KV_GIB = 0.25
# The released code predictor's sampling (transformers' subtalker defaults): top-k 50, top-p 0.8, temperature 1;
# greedy with a greedy Talker, as transformers ties them.
PREDICTOR_TOP_K, PREDICTOR_TOP_P, PREDICTOR_TEMPERATURE = 50, 0.8, 1.0


def _captured(what: str, unit: str, buckets: list[int], note: str = "") -> str:
    """What a stage captured, for the start-up summary (`note`: GraphSet.routes_note)."""
    if not buckets:
        return f"{what} steps eager"
    return f"{what} CUDA graphs for {unit} {', '.join(map(str, buckets))}{note}"


class SpeechStages:
    def __init__(
        self,
        config: EngineConfig,
        path: Path,
        cfg: Qwen3OmniConfig,
        dtype: torch.dtype,
        max_len: int,
        shared: bool,
        speaking: int,
    ) -> None:
        """The Talker, code predictor and Code2Wav on the talker stage's device, and the Talker's pages (one
        page on a GPU until the plan sizes them, `allocate`). `max_len`: the longest Talker sequence; `shared`:
        their device is the Thinker's; `speaking`: the most speaking requests in flight, each an audio stream."""
        self.config, self.model_config, self.max_len, self.speaking = config, cfg, max_len, speaking
        self.device = resolve_device(config.stage("talker").device)
        with self.on_device():
            self._load(path, dtype, shared)

    def _load(self, path: Path, dtype: torch.dtype, shared: bool) -> None:
        config, cfg, device = self.config, self.model_config, self.device
        talker, predictor, c2w = (
            config.stage("talker"),
            config.stage("code_predictor"),
            config.stage("code2wav"),
        )
        options = LoadOptions(dtype, device, config.load_format, config.seed)
        self.talker = load_talker(
            path, options, backend_for(device, config.flash_prefill, config.long_prefill_kernel)
        )
        self.code_predictor = load_code_predictor(path, options)
        if device.type == "cuda":
            adopted = adopt_gemv(self.talker) + adopt_gemv(self.code_predictor)
            log.info("one-row projections on the Triton GEMV: %d (%s)", len(adopted), ", ".join(adopted[:4]))
        compiled = device.type == "cuda" and config.compile
        if compiled:
            # as the Thinker's: the layers' norms, rotary and residual glue fused. A frame of the code predictor
            # is 15 steps of 5 small layers, hundreds of kernels even in a graph, where each costs microseconds.
            # The Talker's layers are the Thinker's code at other sizes: their variants join the Thinker's under
            # one code object, past dynamo's default limit of 8, beyond which calls silently run eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            for layer in (*self.talker.model.layers, *self.code_predictor.model.layers):
                layer.compile(dynamic=True)
        self.code2wav = load_code2wav(path, options)
        if device.type == "cuda":
            phased = adopt_polyphase(self.code2wav, c2w.max_streams, c2w.chunk)
            log.info(
                "Code2Wav's dilated convs in the polyphase form: %d (%s)", len(phased), ", ".join(phased)
            )
            torch.cuda.empty_cache()  # the timed call's activations, before the plan measures what is free
        text = cfg.talker.text
        page_bytes = text.kv_bytes_per_token * config.page_size
        # on a GPU the plan sizes the pool (`allocate`); until then it has one page
        pages = talker.kv.pages or max(1, int((talker.kv.gib or _CPU_TALKER_KV_GIB) * GiB) // page_bytes)
        vocab, eos = text.vocab_size, cfg.talker.codec_eos_token_id
        runner = RowRunner(
            self.talker,
            text,
            config.page_size,
            device,
            dtype,
            max_seqs=talker.max_batch,
            # the codec's top 1024 ids are control codes, never audio; EOS among them ends the speech
            suppressed_ids=[i for i in range(vocab - 1024, vocab) if i != eos],
        )
        self.talker_stage = RowStage(
            runner,
            num_pages=1 if device.type == "cuda" else pages,
            max_num_seqs=talker.max_batch,
            max_num_batched_tokens=talker.max_num_batched_tokens,
            eos_token_id=eos,
            max_seq_len=self.max_len,
            decode_sizes=talker.graphs.sizes(decode_buckets),
            prefill_sizes=talker.prefill_graphs.sizes(prefill_buckets),
            kv=self._talker_pool(shared),
        )
        frame_graphs = FrameGraphs(
            self.code_predictor,
            self.talker.model.codec_embedding,
            PREDICTOR_TOP_K,
            max_batch=predictor.max_batch,
            enforce_eager=predictor.enforce_eager,
        )
        self.frame_stage = FrameStage(
            self.code_predictor, frame_graphs, predictor.graphs.sizes(decode_buckets)
        )
        # a state slot for each stream in flight; where more may speak at once than the Talker runs, its batch
        # and a call's streams still to end after their Talker did (the others with a chunk due wait for one)
        decoder = ChunkDecoder(self.code2wav, min(self.speaking, talker.max_batch + c2w.max_streams))
        code2wav_graphs = Code2WavGraphs(
            decoder, {c2w.first_chunk, c2w.chunk}, c2w.max_streams, enforce_eager=c2w.enforce_eager
        )
        self.code2wav_stage = Code2WavStage(
            decoder, code2wav_graphs, c2w.max_streams, c2w.chunk, c2w.graphs.sizes(decode_buckets)
        )
        self.streamer = Code2WavStreamer(
            self.code2wav,
            c2w.first_chunk,
            c2w.chunk,
            max_batch=c2w.max_streams,
            slots=decoder.slots,
            decode=code2wav_graphs,
        )
        self.tokens = SpeechTokens.from_config(cfg)

    def on_device(self) -> contextlib.AbstractContextManager:
        """The speech device as the current one: Triton launches on the current device, not the tensors'."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _talker_pool(self, shared: bool) -> KVPool:
        """What the Talker's KV pool asks of the plan: one request of its longest length at least; on a device
        shared with the Thinker, a share of the KV memory that gives both pools about as many tokens, unless
        the config sizes it."""
        cfg, text = self.config, self.model_config.talker.text
        talker = cfg.stage("talker")
        page_bytes = text.kv_bytes_per_token * cfg.page_size
        min_pages = -(-self.max_len // cfg.page_size)
        fixed = talker.kv.pages or (int(talker.kv.gib * GiB) // page_bytes if talker.kv.gib else None)
        share = None
        if fixed is None and shared:
            thinker_pool = cfg.stage("thinker").kv
            thinker = self.model_config.thinker.text.kv_bytes_per_token
            if thinker_pool.pages or thinker_pool.gib:  # a fixed Thinker pool: as many tokens in the Talker's
                thinker_pages = thinker_pool.pages or int((thinker_pool.gib or 0) * GiB) // (
                    thinker * cfg.page_size
                )
                fixed = max(min_pages, thinker_pages)
            else:
                share = talker.kv.share or text.kv_bytes_per_token / (thinker + text.kv_bytes_per_token)
        # the model's own length (none configured) may shrink to fit, as the Thinker's does (`plan_device`)
        least = least_pages(self.max_len, cfg.page_size) if cfg.max_model_len is None else None
        return KVPool("Talker", page_bytes, min_pages=min_pages, share=share, pages=fixed, least_pages=least)

    @property
    def stages(self) -> tuple[Stage, Stage, Stage]:
        """The Talker, the code predictor and Code2Wav, in the order they run and join one graph pool."""
        return self.talker_stage, self.frame_stage, self.code2wav_stage

    @property
    def frame_graphs(self) -> FrameGraphs:
        return self.frame_stage.graphs

    @property
    def code2wav_graphs(self) -> Code2WavGraphs:
        return self.code2wav_stage.graphs

    def memory(self) -> StageMemory:
        """What the three stages bring to their device's plan, each its own (`Stage.memory`), and the table of
        projected text rows the Talker reads."""
        talker, frames, code2wav = (stage.memory() for stage in self.stages)
        rows = ("Talker text rows", self._text_rows_bytes(), "talker_input.text_rows")
        return StageMemory(
            resident=(*talker.resident, rows, *frames.resident, *code2wav.resident),
            peaks=(*talker.peaks, *frames.peaks, *code2wav.peaks),
            kv=(*talker.kv, *frames.kv, *code2wav.kv),
            graphs=(*talker.graphs, *frames.graphs, *code2wav.graphs),
        )

    def _text_rows_bytes(self) -> int:
        """The table of projected text rows (talker_input.text_rows), built once the Thinker's embedding loads."""
        weight = self.talker.codec_head.weight
        return (
            self.model_config.thinker.text.vocab_size
            * self.model_config.talker.text.hidden_size
            * weight.element_size()
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """Each stage's grant of `plan`, in turn: the Talker's pages then graphs (the graphs record the pages'
        addresses), the code predictor's and Code2Wav's graphs. The three run one after another on the device's
        main stream: one graph memory pool, `pool` (the Thinker's main-stream pool where they share its device,
        `MAIN_POOL`) or the first one a stage makes."""
        for stage in self.stages:
            stage.allocate(plan, pool)
            pool = pool or stage.graph_pool

    def summary(self) -> str:
        """What the start-up line says of the three stages."""
        pool, streamer, frames = self.talker_stage.pool, self.streamer, self.frame_graphs
        talker = self.talker_stage.runner
        talker_note = talker.graphs.routes_note() if talker.graphs is not None else ""
        prefill = talker.prefill_graphs
        frame_buckets = int_buckets(frames.captured_buckets)
        streams = sorted({b[1] for b in self.code2wav_graphs.captured_buckets if isinstance(b, tuple)})
        return (
            f"speech: Talker KV {pool.num_pages:,} pages x {pool.page_size} tokens, "
            f"{_captured('Talker decode', 'batch', talker.captured_buckets, talker_note)}, "
            f"{_captured('Talker prefill', 'tokens', int_buckets(prefill.captured_buckets) if prefill else [])}, "
            f"{_captured('code predictor frame', 'batch', frame_buckets, frames.routes_note())}, "
            f"Code2Wav chunks of {streamer.first_chunk} then {streamer.chunk} frames, up to "
            f"{streamer.max_batch} streams a call: "
            f"{_captured('Code2Wav', 'streams', streams)}"
        )
