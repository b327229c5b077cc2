"""The code predictor's frame graphs at the released sizes (random bf16 weights): a replayed frame equals the
eager frame, for greedy and sampled rows, frame after frame, in full and padded buckets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage.bench.skeletons import released_skeleton
from omnistage.engine.graphs.frames import FrameGraphs
from omnistage.engine.static_sampling import StaticRows, sample_static
from omnistage.models.loader import LoadOptions, fill_random_
from omnistage.models.qwen3_omni.code_predictor import load_code_predictor
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV, TOP_K, TOP_P, FRAMES = "cuda", 50, 0.8, 2
BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def runner() -> FrameGraphs:
    checkpoint = released_skeleton()
    predictor = load_code_predictor(checkpoint, LoadOptions(torch.bfloat16, DEV, load_format="dummy")).eval()
    talker = Qwen3OmniConfig.from_dir(checkpoint).talker.text
    # only the Talker's code-0 table enters a frame; the rest of the Talker is not needed here
    code0_embedding = nn.Embedding(talker.vocab_size, talker.hidden_size, device=DEV, dtype=torch.bfloat16)
    fill_random_(code0_embedding, seed=1)
    runner = FrameGraphs(predictor, code0_embedding.requires_grad_(False), TOP_K, max(BUCKETS))
    assert runner.capture(BUCKETS) == BUCKETS and runner.captured_buckets == BUCKETS
    return runner


@torch.inference_mode()
def eager_frames(runner, hidden, code0, greedy, seeds, draws, bucket):
    """`predict_frame` eagerly on the batch padded to `bucket` as the runner pads it (zero rows), so that
    every kernel has the replay's shapes. Unpadded, batch 3's matmuls have 3 rows, not 4, and cuBLAS may pick
    another kernel: its bf16 logits can then differ in the last bit, and random weights give exact top-2 ties
    in bf16 often enough (about one argmax in twenty) that such a bit flips a code. The CPU test checks the
    padded frames against the unpadded ones exactly."""
    batch, pad = hidden.shape[0], bucket - hidden.shape[0]
    hidden = torch.cat((hidden, hidden.new_zeros(pad, hidden.shape[1])))
    code0 = torch.cat((code0, code0.new_zeros(pad)))
    rows = StaticRows.empty(bucket, DEV)
    rows.fill(greedy, [1.0] * batch, [TOP_P] * batch, seeds, draws)
    embeds = runner.code0_embedding(code0)
    frames = []
    for _ in range(FRAMES):
        codes, sums = runner.predictor.predict_frame(
            hidden, embeds, lambda logits: sample_static(logits, rows, TOP_K)
        )
        frames.append((codes[:batch], sums[:batch]))
    return frames


def test_batches_replay_the_fastest_bucket_that_holds_them(runner):
    assert sorted(runner.replay_ms) == BUCKETS and all(ms > 0 for ms in runner.replay_ms.values())
    for bucket, chosen in runner.routes.items():
        assert chosen in BUCKETS and chosen >= bucket
        assert runner.replay_ms[chosen] <= runner.replay_ms[bucket]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_replayed_frames_equal_eager_frames(runner, batch):
    g = torch.Generator(device=DEV).manual_seed(batch)
    hidden = torch.randn(batch, runner.predictor.config.hidden_size, generator=g, device=DEV)
    hidden = hidden.to(torch.bfloat16)
    code0 = torch.randint(0, runner.code0_embedding.num_embeddings, (batch,), generator=g, device=DEV)
    greedy = [b % 2 == 0 for b in range(batch)]
    seeds = [1000 + b for b in range(batch)]
    draws = [15 * b for b in range(batch)]
    steps = runner.predictor.config.num_code_groups - 1
    bucket = runner.bucket_for(batch)  # 1 -> 1, 3 -> 4, 8 -> 8, or a faster larger bucket (routes)
    assert bucket in BUCKETS and bucket >= batch
    want = eager_frames(runner, hidden, code0, greedy, seeds, draws, bucket)
    for want_codes, want_sums in want:
        codes, sums = runner.run(
            hidden, code0, greedy=greedy, temperature=[1.0] * batch, top_p=[TOP_P] * batch, seeds=seeds,
            draws=draws,
        )  # fmt: skip
        # the replay launches the eager frame's kernels on the same shapes, and a sampled row's noise is a
        # pure function of (seed, draw): every code matches, sampled rows' too
        assert torch.equal(codes, want_codes)
        torch.testing.assert_close(sums, want_sums, rtol=1.6e-2, atol=1e-2)
        assert runner.buffers.rows.draws[:batch].tolist() == [d + steps for d in draws]
        draws = [d + steps for d in draws]
    if batch > 1:  # the same inputs twice: a sampled row drew new codes
        assert not torch.equal(want[0][0][1], want[1][0][1])


def test_graph_costs_grow_with_the_bucket(runner):
    costs = runner.graph_costs(BUCKETS)
    assert sorted(costs) == BUCKETS
    assert all(0 < costs[a].bytes <= costs[b].bytes for a, b in zip(BUCKETS, BUCKETS[1:]))
    assert all(0 < p.kept < p.bytes for p in costs.values())  # the codes and sums stay; the rest is scratch
