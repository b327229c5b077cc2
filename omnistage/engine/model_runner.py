"""Turns a scheduled step into tensors, runs the model over its paged KV, and returns the logits to sample.

The only place where scheduler bookkeeping meets tensors: flat token ids, 3-stream M-RoPE positions and
the attention metadata are built on the host from the chunks, moved to the device once, and the rows
that end a sampling chunk go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.attention import AttentionMetadata
from omnistage.engine.scheduler import ScheduledChunk, SchedulerOutput
from omnistage.models.qwen3_omni.config import TextConfig
from omnistage.models.qwen3_omni.thinker import Thinker


@dataclass
class PromptPositions:
    """M-RoPE positions of a multimodal prompt `[3, prompt_len]`; generated tokens continue at p + delta."""

    positions: torch.Tensor
    delta: int


def positions_for(start: int, count: int, mrope: PromptPositions | None) -> torch.Tensor:
    """`[3, count]` positions of tokens start..start+count: text tokens share one position in all streams."""
    if mrope is None:
        return torch.arange(start, start + count).expand(3, count)
    prompt_len = mrope.positions.shape[1]
    head = mrope.positions[:, start : min(start + count, prompt_len)]
    tail_start = max(start, prompt_len)
    tail = torch.arange(tail_start, start + count).add(mrope.delta).expand(3, -1)
    return torch.cat([head, tail], dim=1)


class ModelRunner:
    def __init__(
        self,
        model: Thinker,
        cfg: TextConfig,
        num_pages: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.device = device
        shape = (2, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions = []
        for chunk in chunks:
            ids += chunk.seq.all_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            positions.append(positions_for(chunk.start, chunk.num_tokens, _mrope(chunk)))
        meta = AttentionMetadata.build(
            [(c.start, c.num_tokens, c.seq.page_ids) for c in chunks], self.page_size, self.device
        )
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, torch.cat(positions, dim=1).to(self.device, non_blocking=True), meta

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits `[n, vocab]` (float32) for the n chunks of `step` that end in a sample, in chunk order."""
        input_ids, positions, meta = self.prepare(step.chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        last_rows = meta.query_start_loc[1:].long() - 1
        sampling = torch.tensor([c.samples for c in step.chunks], device=self.device)
        return self.model.compute_logits(hidden[last_rows[sampling]])


def _mrope(chunk: ScheduledChunk) -> PromptPositions | None:
    return getattr(chunk.seq.data, "mrope", None)
