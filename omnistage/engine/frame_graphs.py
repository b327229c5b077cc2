"""CUDA graphs for the code predictor: one graph per batch bucket holds the G - 1 inner steps of a frame.

Eagerly a frame is 15 steps of a 5-layer decoder over a handful of rows: hundreds of tiny kernels, so the
launches, not the GPU, set its time. Every row of a batch sits at the same inner position at every step
(`CodePredictor.predict_frame` keeps its K/V in a static per-frame cache), and the sampling is
`static_sampling.sample_static` (per-row settings in device tensors, counter-based noise advancing on the
device), so the whole frame, code 0's embedding through the Talker's table included, is one replay.

A batch of B frames is padded to the smallest captured bucket: padding rows get hidden state 0 and code 0,
and their own rows of the per-frame cache; every op of a frame works row by row, so what padding rows
compute (then discarded) never reaches a real row. Off CUDA, `capture` binds static-eager calls over the
same buffers (`GraphSet`), so the padding is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from omnistage.engine.gpu_memory import Peak, device_peak, scaled_peaks
from omnistage.engine.graphs import GraphSet
from omnistage.engine.static_sampling import StaticRows, sample_static
from omnistage.models.qwen3_omni.code_predictor import CodePredictor


class StaticFrameBuffers:
    """A frame's inputs, sampling settings and per-frame K/V sized for the largest bucket; a bucket uses the
    first rows (the K/V as a view of its batch dimension)."""

    def __init__(self, predictor: CodePredictor, max_batch: int, device: torch.device | str) -> None:
        self.capacity = max_batch
        weight = cast(nn.Linear, predictor.lm_head[0]).weight
        self.hidden = torch.zeros(max_batch, weight.shape[1], dtype=weight.dtype, device=device)
        self.code0 = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = StaticRows.empty(max_batch, device)
        self.kv = predictor.new_kv(max_batch)

    def args(self, bucket: int) -> tuple:
        """The frame's arguments for a graph of `bucket` rows (`rows` whole: the sampler reads its first rows)."""
        return self.hidden[:bucket], self.code0[:bucket], self.rows, self.kv[:, :, :bucket]

    def fill(
        self,
        hidden: torch.Tensor,
        code0: torch.Tensor,
        sampling: tuple[Sequence[bool], Sequence[float], Sequence[float], Sequence[int], Sequence[int]],
        bucket: int,
    ) -> None:
        """Copy B rows into rows [0, B) and zero the inputs of rows [B, bucket); device copies, no sync.
        Padding rows keep their old sampling settings: rows never mix, so any settings do."""
        batch = hidden.shape[0]
        self.hidden[:batch].copy_(hidden)
        self.hidden[batch:bucket].zero_()
        self.code0[:batch].copy_(code0)
        self.code0[batch:bucket].zero_()
        self.rows.fill(*sampling)

    def clear(self, bucket: int) -> None:
        """Rows [0, bucket) as padding, greedy (before warm-up and capture)."""
        self.hidden[:bucket].zero_()
        self.code0[:bucket].zero_()
        self.rows.greedy[:bucket] = True
        self.rows.draws[:bucket] = 0


class FrameGraphRunner(GraphSet):
    """Codes 1..G-1 and the codec embedding sum of one frame per row, a captured graph per batch bucket.

    `code0_embedding` is the Talker's `codec_embedding` (code 0's table; the predictor embeds codes 1..G-1).
    Sampling is `sample_static` with `top_k` for every row. The tensors `run` returns are views of the graph's
    static outputs: use (or clone) them before the next `run`.
    """

    kind = "code predictor"
    unit = "batch"
    route_by_speed = True

    def __init__(
        self,
        predictor: CodePredictor,
        code0_embedding: nn.Embedding,
        top_k: int,
        max_batch: int,
        enforce_eager: bool = False,
    ) -> None:
        self.predictor = predictor
        self.code0_embedding = code0_embedding
        self.top_k = top_k
        device = cast(nn.Linear, predictor.lm_head[0]).weight.device
        super().__init__(self._frame, StaticFrameBuffers(predictor, max_batch, device), device, enforce_eager)

    @torch.inference_mode()
    def _frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, rows: StaticRows, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.predictor.predict_frame(
            hidden, self.code0_embedding(code0), lambda logits: sample_static(logits, rows, self.top_k), kv
        )

    def run(
        self,
        hidden: torch.Tensor,
        code0: torch.Tensor,
        *,
        greedy: Sequence[bool],
        temperature: Sequence[float],
        top_p: Sequence[float],
        seeds: Sequence[int],
        draws: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes 1..G-1 `[B, G-1]` and embedding sums `[B, H]` of B frames: the Talker's final-norm hidden
        states `[B, H]` and code-0 ids `[B]`, with each row's sampling settings, seed and first draw number
        (a frame takes G - 1 draws: the next frame's is `draws[b] + G - 1`). Replays the smallest captured
        bucket that holds B rows, or runs eagerly."""
        sampling = (greedy, temperature, top_p, seeds, draws)
        batch = hidden.shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None:
            rows = StaticRows.empty(batch, self.device)
            rows.fill(*sampling)
            return self._frame(hidden, code0, rows, self.predictor.new_kv(batch))
        self.buffers.fill(hidden, code0, sampling, bucket)
        self._replays[bucket]()
        codes, sums = self._outputs[bucket]
        return codes[:batch], sums[:batch]

    def profile_peak(self, batch: int) -> Peak:
        """Bytes an eager frame of `batch` rows over the static buffers allocates at its peak, and what it keeps
        (its codes and sums: a graph's outputs; CUDA only)."""
        self.buffers.clear(batch)
        with device_peak(self.device) as peak:
            out = self._frame(*self.buffers.args(batch))
        del out
        torch.cuda.empty_cache()
        return peak

    def graph_costs(self, buckets: list[int]) -> dict[int, Peak]:
        """Graph memory per bucket for the planner, priced as the LLM stages' graphs are (`scaled_peaks` of
        the largest bucket's measured eager frame). Off CUDA nothing is captured, so nothing is priced."""
        if self.device.type != "cuda" or not buckets:
            return {}
        return scaled_peaks(self.profile_peak(max(buckets)), buckets)
