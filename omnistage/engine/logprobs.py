"""The log-probabilities a step's rows asked for (`SamplingParams.logprobs`), beside the ids the sampler drew.

They are log_softmax of the model's raw logits, before logit bias, penalties, the min_tokens mask and
temperature: vLLM's default (its `raw_logprobs` mode), so a token's logprob says what the model thought of it,
whatever the request's sampling made of that. They stay on the device with the sampled ids until the step's
ids are read back (a decode step run ahead copies them to the host beside its ids), and a step in which no row
asks computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.engine.sampling import SamplingRow
from omnistage.models.layers.attention_metadata import to_device
from omnistage.outputs import TokenLogprobs


@dataclass
class StepLogprobs:
    """The log-probabilities of one step's rows that asked, on the device or, after `to_host`, on the host."""

    rows: list[int]  # the batch rows that asked, in order
    counts: list[int]  # how many top tokens each of them asked for
    sampled: Tensor  # [R] float32: each row's sampled token's
    top_ids: Tensor  # [R, K] long, K the largest count: the most likely tokens, most likely first
    top: Tensor  # [R, K] float32: their logprobs

    def to_host(self) -> StepLogprobs:
        """This step's tensors copied to the host; from a GPU into pinned memory without waiting, so that the
        copy is complete once an event recorded after it is (decode_ahead.Launched)."""
        return StepLogprobs(self.rows, self.counts, _host(self.sampled), _host(self.top_ids), _host(self.top))

    def per_row(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        """Each batch row's TokenLogprobs (None where it did not ask), its sampled id from `token_ids`; reads
        the tensors, so on the host once their copy is complete."""
        found: list[TokenLogprobs | None] = [None] * len(token_ids)
        sampled, top_ids, top = self.sampled.tolist(), self.top_ids.tolist(), self.top.tolist()
        for r, (row, k) in enumerate(zip(self.rows, self.counts)):
            found[row] = TokenLogprobs(
                token_ids[row], sampled[r], tuple(zip(top_ids[r][:k], top[r][:k], strict=True))
            )
        return found


def step_logprobs(logits: Tensor, sampled: Tensor, rows: list[SamplingRow]) -> StepLogprobs | None:
    """The logprobs of the rows of `rows` that ask for them: their sampled tokens' (`sampled`, [B] ids) and
    their top tokens', from `logits` ([B, V], as the model gave them: untouched by the sampler). None, with no
    device work, where no row asks."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return None
    counts = [rows[i].params.logprobs or 0 for i in asked]
    if len(asked) < len(rows):
        index = to_device(torch.tensor(asked), logits.device)
        logits, sampled = logits.index_select(0, index), sampled.index_select(0, index)
    logprobs = logits.float().log_softmax(dim=-1)
    top, top_ids = logprobs.topk(max(counts), dim=-1)  # sorted, most likely first
    return StepLogprobs(asked, counts, logprobs.gather(1, sampled[:, None])[:, 0], top_ids, top)


def _host(tensor: Tensor) -> Tensor:
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
