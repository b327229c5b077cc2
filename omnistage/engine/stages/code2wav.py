"""Code2Wav as a stage: the streams' chunks of codes to PCM, many streams a call, through `Code2WavGraphs`
(bucket: chunk x streams). The streaming itself (which stream's chunk is due, its context) is the streamer's
(models/qwen3_omni/code2wav_streamer.py), which calls these graphs; what the stage brings to its device's
plan is its weights, the peak of its largest call and its graphs' measured prices."""

from __future__ import annotations

from typing import Any, cast

import torch

from omnistage.engine.graphs.code2wav import Code2WavGraphs, WindowDecoder
from omnistage.engine.memory.measure import device_peak, graph_candidates, module_bytes
from omnistage.engine.memory.plan import MAIN_POOL, MemoryPlan, StageMemory
from omnistage.engine.stages.base import OverGraphs


class Code2WavStage(OverGraphs):
    graphs: Code2WavGraphs
    name = "Code2Wav"

    def __init__(
        self,
        model: WindowDecoder,
        graphs: Code2WavGraphs,
        max_streams: int,
        chunk: int,
        stream_sizes: list[int],
    ) -> None:
        """`max_streams`: the most streams one call decodes, `chunk` frames each after the first;
        `stream_sizes`: the streams buckets the plan may grant (the stage's graph settings)."""
        self.model, self.graphs = model, graphs
        self.max_streams, self.chunk, self.stream_sizes = max_streams, chunk, set(stream_sizes)

    def memory(self) -> StageMemory:
        """Its weights, the measured peak of a full call (every stream, a chunk and its context each; GPU
        only) and its graphs' prices on its whole ladder of streams, as the set measures its largest."""
        window = self.model.left_context + self.chunk
        quantizers = self.model.config.num_quantizers
        codes = torch.zeros(self.max_streams, quantizers, window, dtype=torch.long, device=self.device)
        starts = torch.zeros(self.max_streams, dtype=torch.long, device=self.device)
        with torch.inference_mode(), device_peak(self.device) as peak:
            self.model.decode_window(codes, starts)
        torch.cuda.empty_cache()
        costs = {
            key: cost
            for key, cost in self.graphs.graph_costs(self.graphs.buckets).items()
            if isinstance(key, tuple) and key[1] in self.stream_sizes
        }
        graphs = graph_candidates(self.name, "decode", "chunk x streams", costs, MAIN_POOL)
        return StageMemory(
            resident=((self.name, module_bytes(self.model), "weights"),),
            peaks=((self.name, peak.bytes, f"{self.max_streams} streams × {window} frames"),),
            graphs=(graphs,) if graphs.costs else (),
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """The (chunk, streams) graphs `plan` grants, into `pool` (or a new one)."""
        self.graphs.capture(
            cast("tuple[tuple[int, int], ...]", plan.captured(self.name, "decode")), pool=pool
        )
