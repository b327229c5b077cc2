"""Code2Wav as a stage: the streams' chunks of codes to PCM, many streams a call, through `Code2WavGraphs`
(bucket: chunk x streams). The streaming itself (which stream's chunk is due, its slot) is the streamer's
(models/qwen3_omni/code2wav_streamer.py), which calls these graphs; what the stage brings to its device's
plan is its weights, the streams' state slots, the peak of its largest call and its graphs' measured
prices."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from omnistage.engine.graphs.code2wav import ChunkDecode, Code2WavGraphs
from omnistage.engine.memory.measure import device_peak, graph_candidates, module_bytes
from omnistage.engine.memory.plan import MAIN_POOL, MemoryPlan, StageMemory
from omnistage.engine.stages.base import OverGraphs


class SlottedDecoder(ChunkDecode, Protocol):
    """A chunk decoder that says what it holds: its model and its state slots."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def slots(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...


class Code2WavStage(OverGraphs):
    graphs: Code2WavGraphs
    name = "Code2Wav"

    def __init__(
        self,
        decoder: SlottedDecoder,
        graphs: Code2WavGraphs,
        max_streams: int,
        chunk: int,
        stream_sizes: list[int],
    ) -> None:
        """`max_streams`: the most streams one call decodes, `chunk` frames each after the first;
        `stream_sizes`: the streams buckets the plan may grant (the stage's graph settings)."""
        self.decoder, self.graphs = decoder, graphs
        self.max_streams, self.chunk, self.stream_sizes = max_streams, chunk, set(stream_sizes)

    def memory(self) -> StageMemory:
        """Its weights and state slots, the measured peak of a full call (every stream, a chunk each, in the
        scratch slot; GPU only) and its graphs' prices on its whole ladder of streams, as the set measures its
        largest."""
        decoder, streams = self.decoder, self.max_streams
        codes = torch.zeros(streams, decoder.num_quantizers, self.chunk, dtype=torch.long, device=self.device)
        starts = torch.zeros(streams, dtype=torch.long, device=self.device)
        slots = torch.full((streams,), decoder.scratch, device=self.device)
        with torch.inference_mode(), device_peak(self.device) as peak:
            decoder(codes, starts, slots)
        torch.cuda.empty_cache()
        costs = {
            key: cost
            for key, cost in self.graphs.graph_costs(self.graphs.buckets).items()
            if isinstance(key, tuple) and key[1] in self.stream_sizes
        }
        graphs = graph_candidates(self.name, "decode", "chunk x streams", costs, MAIN_POOL)
        return StageMemory(
            resident=(
                (self.name, module_bytes(decoder.model), "weights"),
                (f"{self.name} streams", decoder.state_bytes, f"{decoder.slots} state slots"),
            ),
            peaks=((self.name, peak.bytes, f"{streams} streams × {self.chunk} frames"),),
            graphs=(graphs,) if graphs.costs else (),
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """The (chunk, streams) graphs `plan` grants, into `pool` (or a new one)."""
        self.graphs.capture(
            cast("tuple[tuple[int, int], ...]", plan.captured(self.name, "decode")), pool=pool
        )
