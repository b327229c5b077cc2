"""The batched sampler that applies each row's SamplingParams (omnistage/request.py)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from omnistage.models.layers.attention_metadata import to_device, to_device_together
from omnistage.request import MAX_LOGIT_BIAS, SamplingParams

if TYPE_CHECKING:
    from omnistage.engine.structured import GrammarState


@dataclass
class SamplingRow:
    """One batch row as the sampler sees it: the request's parameters and its tokens so far."""

    params: SamplingParams
    # with output_token_ids, what the repetition penalty looks at: the prompt (the output ids may repeat here)
    token_ids: list[int]
    output_token_ids: list[int]  # output only, for presence/frequency penalties and min_tokens
    generator: torch.Generator | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # constrained decoding: the tokens its grammar allows next


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded from `params.seed` on `device`, or None for an unseeded request."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    # OpenAI seeds may be any integer; torch takes [0, 2**64).
    generator.manual_seed(params.seed % 2**64)
    return generator


def _count_index(id_lists: list[list[list[int]]], vocab: int) -> Tensor:
    """Host int64 indices into a flat `[len(id_lists), vocab + 1]` table: one per id of every list of
    id_lists[i] in row i; out-of-vocab ids land in the extra column `vocab`, which `_counts` drops."""
    lengths = [sum(len(ids) for ids in lists) for lists in id_lists]
    # numpy reads lists of ints several times faster than torch.tensor
    flat = np.fromiter(
        itertools.chain.from_iterable(itertools.chain.from_iterable(id_lists)), np.int64, sum(lengths)
    )
    rows = np.repeat(np.arange(len(id_lists), dtype=np.int64), lengths)
    return torch.from_numpy(rows * (vocab + 1) + flat.clip(0, vocab))


def _counts(index: Tensor, num_rows: int, vocab: int) -> Tensor:
    """`[num_rows, vocab]` float32 occurrence counts from `_count_index`'s indices (on the device)."""
    counts = torch.zeros(num_rows * (vocab + 1), dtype=torch.float32, device=index.device)
    counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(num_rows, vocab + 1)[:, :vocab]


def apply_penalties(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Repetition (HF) over prompt and output, then presence and frequency (OpenAI) over output tokens.

    Only rows whose parameters ask for a penalty are touched; returns `logits` itself when none do,
    else a new tensor. Every index and setting reaches the device in one copy.
    """
    repetition = [
        i
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0 and (r.token_ids or r.output_token_ids)
    ]
    additive = [
        i
        for i, r in enumerate(rows)
        if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0) and r.output_token_ids
    ]
    if not repetition and not additive:
        return logits
    vocab = logits.shape[1]
    host: list[Tensor] = []
    if repetition:
        host += [
            torch.tensor(repetition),
            _count_index([[rows[i].token_ids, rows[i].output_token_ids] for i in repetition], vocab),
            torch.tensor([rows[i].params.repetition_penalty for i in repetition])[:, None],
        ]
    if additive:
        host += [
            torch.tensor(additive),
            _count_index([[rows[i].output_token_ids] for i in additive], vocab),
            torch.tensor([rows[i].params.frequency_penalty for i in additive])[:, None],
            torch.tensor([rows[i].params.presence_penalty for i in additive])[:, None],
        ]
    moved = iter(to_device_together(host, logits.device))
    logits = logits.clone()
    if repetition:
        index, ids, penalty = next(moved), next(moved), next(moved)
        seen = _counts(ids, len(repetition), vocab) > 0
        sub = logits[index]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(seen, penalised, sub)
    if additive:
        index, ids, frequency, presence = next(moved), next(moved), next(moved), next(moved)
        counts = _counts(ids, len(additive), vocab)
        logits[index] = logits[index] - frequency * counts - presence * (counts > 0).float()
    return logits


def apply_logit_bias(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Add each row's logit bias to its tokens' logits; a bias at OpenAI's floor (-100) bans its token (-inf),
    as OpenAI says it should, where adding it would leave a token whose logit is large still drawable.

    Returns `logits` itself when no row has a bias, else a new tensor; every index and bias reaches the device
    in one copy. Ids beyond the vocabulary are skipped (admission refuses them for the stage's own requests).
    """
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, logit_bias in biased:
        for token, bias in logit_bias.items():
            if 0 <= token < vocab:
                row_index.append(i)
                token_index.append(token)
                biases.append(-math.inf if bias <= -MAX_LOGIT_BIAS else bias)
    if not row_index:
        return logits
    at_rows, at_tokens, added = to_device_together(
        [torch.tensor(row_index), torch.tensor(token_index), torch.tensor(biases, dtype=logits.dtype)],
        logits.device,
    )
    logits = logits.clone()
    logits[at_rows, at_tokens] += added  # one entry per (row, token): a row's bias is a dict
    return logits


def apply_min_tokens(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Mask eos and stop token ids to -inf on rows that have produced fewer than min_tokens tokens.

    The sampler masks whatever `eos_token_ids` the row carries; ignore_eos is the engine's business.
    Returns `logits` itself when no row is masked, else a new tensor.
    """
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            blocked = sorted({*r.eos_token_ids, *(r.params.stop_token_ids or [])})
            blocked = [t for t in blocked if 0 <= t < vocab]
            row_index += [i] * len(blocked)
            token_index += blocked
    if not row_index:
        return logits
    at_rows, at_tokens = to_device_together(
        [torch.tensor(row_index), torch.tensor(token_index)], logits.device
    )
    logits = logits.clone()
    logits[at_rows, at_tokens] = -math.inf
    return logits


def apply_grammars(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Mask to -inf, on each constrained row, the tokens its grammar forbids next (the padded columns past the
    tokenizer among them). Returns `logits` itself when no row is constrained, else a new tensor."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    # imported here: xgrammar's import takes seconds, which a server without constrained requests never pays
    from omnistage.engine.structured import apply_bitmask, fill_bitmask

    states = [g for r in rows if (g := r.grammar) is not None]
    bitmask = fill_bitmask(states, constrained, len(rows), logits.shape[1])
    logits = logits.clone()
    # pinned and not waited for: a step decoded ahead fills its masks while the device runs its forward pass,
    # which the host must not wait for (decode_ahead.py)
    apply_bitmask(logits, to_device(bitmask, logits.device))
    return logits


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, head: int | None = None) -> Tensor:
    """Keep each row's top_k highest logits, then the smallest head whose probability reaches top_p.

    `head`: the largest top_k of the batch when every row has one. Only that many candidates are ranked
    (a top-k instead of a sort of the whole vocabulary: the code predictor's top-50 of 2048 codes, 15 times a
    frame), and the rest are -inf, as the full sort would make them.
    """
    if head is not None:
        sorted_logits, order = logits.topk(head, dim=-1)
        kept = _apply_top_k_top_p(sorted_logits, top_k, top_p)
        return torch.full_like(logits, -math.inf).scatter(1, order, kept)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], -math.inf)
    return logits.scatter(1, order, sorted_logits)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's largest.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, -math.inf)


@dataclass
class _BatchSettings:
    """A batch's per-row settings on the device; None where no row uses the setting."""

    temperature: Tensor  # 1.0 on greedy rows
    greedy: Tensor | None  # bool: rows that take the argmax (None: no row does)
    top_k: Tensor | None
    top_p: Tensor | None
    head: int | None  # see _apply_top_k_top_p
    min_p: Tensor | None


class Sampler:
    """Turns one step's logits into next tokens, each row under its own SamplingParams.

    The settings tensors of a batch are kept from one step to the next while every row's settings stay the
    same, as they do from one decode step to the next: no tensor is built and copied for them then.
    """

    def __init__(self) -> None:
        self._cached: tuple[tuple, _BatchSettings] | None = None  # (the rows' settings, their tensors)

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        return self.sample(logits, rows)

    def sample(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """Next token per row: [B, V] float logits -> [B] long ids on the logits' device.

        Order: logit bias, penalties, min_tokens mask, grammar masks, greedy argmax, temperature, top-k, top-p,
        min-p, softmax, sample.
        A seeded row draws only from its own generator, so its tokens do not depend on its batch neighbours.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits have {logits.shape[0]} rows but {len(rows)} SamplingRows were given")
        logits = apply_penalties(apply_logit_bias(logits.float(), rows), rows)
        logits = apply_grammars(apply_min_tokens(logits, rows), rows)
        greedy_ids = logits.argmax(dim=-1)
        params = [r.params for r in rows]
        if all(p.greedy for p in params):
            return greedy_ids
        settings = self._settings_for(params, logits.shape[1], logits.device)

        # Greedy rows ride along with neutral settings; their draws are discarded below.
        logits = logits / settings.temperature[:, None]
        if settings.top_k is not None and settings.top_p is not None:  # set together
            logits = _apply_top_k_top_p(logits, settings.top_k, settings.top_p, settings.head)
        if settings.min_p is not None:
            logits = _apply_min_p(logits, settings.min_p)
        probs = logits.softmax(dim=-1)

        # argmax(p / q) with q ~ Exp(1) is an exact draw from p (the exponential-race trick).
        seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
        if len(seeded) < len(rows):
            q = torch.empty_like(probs).exponential_()
        else:
            q = torch.empty_like(probs)
        for i in seeded:
            q[i].exponential_(generator=rows[i].generator)  # in place: no row copy
        # exponential_ may return exactly 0; 0/0 would make NaN, which argmax would pick.
        sampled = probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return sampled if settings.greedy is None else torch.where(settings.greedy, greedy_ids, sampled)

    def _settings_for(self, params: list[SamplingParams], vocab: int, device: torch.device) -> _BatchSettings:
        """The batch's settings: the last step's when the rows' settings and the device are the same."""
        key = (vocab, device, [(p.temperature, p.top_k, p.top_p, p.min_p) for p in params])
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1]
        greedy = [p.greedy for p in params]
        truncates = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        host = {
            "temperature": torch.tensor([1.0 if p.greedy else p.temperature for p in params]),
            "greedy": torch.tensor(greedy) if any(greedy) else None,
            "top_k": torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]) if truncates else None,
            # inf, not 1.0: a cumulative sum can round past 1 and must not cut a row that asked for no top-p.
            "top_p": torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params])
            if truncates
            else None,
            "min_p": torch.tensor([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
        }
        used = {name: tensor for name, tensor in host.items() if tensor is not None}
        moved = dict(zip(used, to_device_together(list(used.values()), device)))
        head = (
            max(p.top_k for p in params) if truncates and all(0 < p.top_k < vocab for p in params) else None
        )
        settings = _BatchSettings(
            temperature=moved["temperature"],
            greedy=moved.get("greedy"),
            top_k=moved.get("top_k"),
            top_p=moved.get("top_p"),
            head=head,
            min_p=moved.get("min_p"),
        )
        self._cached = (key, settings)
        return settings
