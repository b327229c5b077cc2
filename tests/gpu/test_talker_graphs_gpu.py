"""The Talker's decode graphs on a GPU (the embedded tiny checkpoint in bfloat16): three requests decoding in
bucket 4, then two in bucket 2, give the hidden states, logits and greedy codes of the eager steps."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.attention import backend_for
from omnistage.engine.stages.row_runner import RowRunner
from omnistage.engine.stages.rows import RowStage
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.models.qwen3_omni.tiny import default_checkpoint
from omnistage.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
PROMPTS, MAX_TOKENS = (5, 8, 11), (8, 8, 5)


def make_stage(talker, cfg: Qwen3OmniConfig) -> RowStage:
    vocab, eos = cfg.talker.text.vocab_size, cfg.talker.codec_eos_token_id
    runner = RowRunner(
        talker, cfg.talker.text, 4, DEV, torch.bfloat16, max_seqs=4,
        suppressed_ids=[i for i in range(vocab - 1024, vocab) if i != eos],
    )  # fmt: skip
    return RowStage(runner, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, eos_token_id=eos)


def speak(stage: RowStage) -> tuple[list[list[tuple]], list[torch.Tensor]]:
    """Greedy requests fed the same rows whatever path runs; per step, (request, code, hidden) of every sample,
    and the logits each step sampled from."""
    logits_seen = []
    sample = stage._sample
    stage._sample = lambda logits, sampling: logits_seen.append(logits.clone()) or sample(logits, sampling)
    g = torch.Generator().manual_seed(0)
    hidden = stage.runner.cfg.hidden_size
    for i, (length, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompt = torch.randn(length, hidden, generator=g).to(DEV)
        stage.add(
            str(i), prompt, PromptPositions(torch.arange(length).expand(3, -1), delta=i), params, max_tokens
        )
    steps = []
    while stage.has_unfinished():
        out = stage.step()
        steps.append([(s.request_id, s.token, s.hidden.float()) for s in out])
        for s in out:
            if not s.finished:
                stage.feed(s.request_id, torch.randn(hidden, generator=g).to(DEV))
    return steps, logits_seen


def test_replay_equals_eager():
    path = default_checkpoint()
    cfg = Qwen3OmniConfig.from_dir(path)
    talker = load_talker(path, LoadOptions(torch.bfloat16, DEV), backend_for(DEV))
    want, want_logits = speak(make_stage(talker, cfg))

    stage = make_stage(talker, cfg)
    costs = stage.runner.graph_costs([1, 2, 4])
    assert sorted(costs) == [1, 2, 4] and 0 < costs[1].bytes <= costs[2].bytes <= costs[4].bytes
    assert all(
        0 < p.kept < p.bytes for p in costs.values()
    )  # the logits and hidden states stay; the rest is scratch
    pool = torch.cuda.graph_pool_handle()
    assert (
        stage.runner.capture_graphs([1, 2, 4], max_seq_len=64, pool=pool)
        == [1, 2, 4]
        == stage.runner.captured_buckets
    )
    assert stage.runner.graphs.pool is pool and sorted(stage.runner.graphs.graph_bytes) == [1, 2, 4]
    replayed = []
    stage.runner.graphs.on_replay = replayed.append
    got, got_logits = speak(stage)

    # the prompts run eagerly; 4 steps of 3 rows replay bucket 4, then 3 steps of 2 rows bucket 2, unless
    # the timing after capture found a larger bucket faster (GraphSet.routes)
    assert sorted(stage.runner.graphs.routes) == [1, 2, 4] and all(
        r >= b for b, r in stage.runner.graphs.routes.items()
    )
    assert replayed == [stage.runner.graphs.bucket_for(3)] * 4 + [stage.runner.graphs.bucket_for(2)] * 3
    assert [[(r, t) for r, t, _ in step] for step in got] == [[(r, t) for r, t, _ in step] for step in want]
    for got_step, want_step in zip(got, want, strict=True):
        for (*_, got_hidden), (*_, want_hidden) in zip(got_step, want_step, strict=True):
            torch.testing.assert_close(got_hidden, want_hidden, rtol=2e-2, atol=2e-2)
    for got_step, want_step in zip(got_logits, want_logits, strict=True):
        assert got_step.dtype == torch.float32 and got_step.isneginf().equal(want_step.isneginf())
        torch.testing.assert_close(got_step, want_step, rtol=2e-2, atol=2e-2)
    assert stage.pool.num_free == stage.pool.num_pages
