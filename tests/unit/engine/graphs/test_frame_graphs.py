"""The code predictor's frame runner on the CPU: capture binds static-eager calls over the padded buffers,
which must give what `predict_frame` with `sample_static` gives eagerly, frame after frame."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.engine.graphs.frames import FrameGraphs
from omnistage.engine.static_sampling import StaticRows, sample_static
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.code_predictor import load_code_predictor
from omnistage.models.qwen3_omni.talker import load_talker

TOP_K = 50
GREEDY = [True, False, False]
TEMPERATURE = [1.0, 1.0, 0.7]
TOP_P = [1.0, 0.8, 0.95]
SEEDS = [11, 12, 13]
FIRST_DRAWS = [0, 5, 40]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    predictor = load_code_predictor(tiny_checkpoint, LoadOptions(torch.float32, "cpu")).eval()
    talker = load_talker(tiny_checkpoint, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend()).eval()
    return predictor, talker.model.codec_embedding


def frame_inputs(predictor, code0_embedding, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, predictor.config.hidden_size, generator=g)
    return hidden, torch.randint(0, code0_embedding.num_embeddings, (batch,), generator=g)


@torch.inference_mode()
def eager_frames(
    predictor, code0_embedding, hidden, code0, frames: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pipeline's eager path: one StaticRows whose draws advance on the device across frames."""
    rows = StaticRows.empty(len(GREEDY), "cpu")
    rows.fill(GREEDY, TEMPERATURE, TOP_P, SEEDS, FIRST_DRAWS)
    embeds = code0_embedding(code0)
    return [
        predictor.predict_frame(hidden, embeds, lambda logits: sample_static(logits, rows, TOP_K))
        for _ in range(frames)
    ]


def run_frame(runner, hidden, code0, draws):
    return runner.run(
        hidden, code0, greedy=GREEDY, temperature=TEMPERATURE, top_p=TOP_P, seeds=SEEDS, draws=draws
    )


def test_padded_frames_equal_the_eager_frames(models):
    predictor, code0_embedding = models
    steps = predictor.config.num_code_groups - 1
    runner = FrameGraphs(predictor, code0_embedding, TOP_K, max_batch=8)
    assert runner.capture([1, 2, 4, 8]) == [1, 2, 4, 8]
    assert runner.bucket_for(3) == 4
    # stale padding row and cache: whatever it computes must not reach the real rows
    runner.buffers.hidden.fill_(float("nan"))
    runner.buffers.kv.fill_(float("nan"))
    runner.buffers.rows.fill([False] * 8, [float("nan")] * 8, [0.5] * 8, [99] * 8, [7] * 8)
    hidden, code0 = frame_inputs(predictor, code0_embedding, 3)
    want = eager_frames(predictor, code0_embedding, hidden, code0, frames=2)
    draws = list(FIRST_DRAWS)
    for want_codes, want_sums in want:
        codes, sums = run_frame(runner, hidden, code0, draws)
        assert torch.equal(codes, want_codes)
        torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6)
        assert runner.buffers.rows.draws[:3].tolist() == [d + steps for d in draws]
        draws = [d + steps for d in draws]
    first, second = want[0][0], want[1][0]
    # the same inputs twice: the greedy row repeats, the sampled rows drew new noise
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1:], second[1:])
    assert torch.isfinite(runner.buffers.hidden[:4]).all()  # the padding row was zeroed


def test_a_batch_routed_to_a_faster_larger_bucket_equals_the_eager_frames(models):
    predictor, code0_embedding = models
    runner = FrameGraphs(predictor, code0_embedding, TOP_K, max_batch=8)
    runner.capture([1, 2, 4, 8])
    runner.routes = {1: 8, 2: 8, 4: 8, 8: 8}  # what a GPU's timing picks where 8 rows replay fastest
    assert runner.bucket_for(3) == 8
    assert runner.routes_note() == " (1 replays 8, 2 replays 8, 4 replays 8: measured faster)"
    runner.buffers.hidden.fill_(float("nan"))
    hidden, code0 = frame_inputs(predictor, code0_embedding, 3)
    (want_codes, want_sums), _ = eager_frames(predictor, code0_embedding, hidden, code0, frames=2)
    codes, sums = run_frame(runner, hidden, code0, FIRST_DRAWS)
    assert torch.equal(codes, want_codes)
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(runner.buffers.hidden[:8]).all()  # all five padding rows were zeroed


def test_a_batch_past_every_bucket_runs_eagerly(models):
    predictor, code0_embedding = models
    runner = FrameGraphs(predictor, code0_embedding, TOP_K, max_batch=2)
    runner.capture([1, 2])
    assert runner.bucket_for(3) is None
    hidden, code0 = frame_inputs(predictor, code0_embedding, 3)
    (want_codes, want_sums), _ = eager_frames(predictor, code0_embedding, hidden, code0, frames=2)
    codes, sums = run_frame(runner, hidden, code0, FIRST_DRAWS)
    assert torch.equal(codes, want_codes)
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6)


def test_no_graph_costs_off_cuda(models):
    predictor, code0_embedding = models
    assert FrameGraphs(predictor, code0_embedding, TOP_K, max_batch=4).graph_costs([1, 2, 4]) == {}
