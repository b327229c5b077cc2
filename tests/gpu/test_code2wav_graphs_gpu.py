"""Code2Wav's chunk graphs at the released sizes (random bf16) on a GPU: every graph captures and is priced,
a replay gives what an eager call gives, and a returned waveform outlives later replays."""

import pytest
import torch

from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FIRST, CHUNK, MAX_STREAMS = 2, 25, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    model = load_model(
        lambda: Code2Wav(cfg), ".", "code2wav.", LoadOptions(torch.bfloat16, "cuda", load_format="dummy")
    )
    # scaled down so that few samples reach the ±1 clamp, where differences would hide
    model.decoder[-1].conv.weight.data /= 64
    model.decoder[-1].conv.bias.data /= 64
    return model


@pytest.fixture(scope="module")
def runner(model) -> Code2WavGraphs:
    runner = Code2WavGraphs(ChunkDecoder(model, MAX_STREAMS), (FIRST, CHUNK), MAX_STREAMS)
    runner.capture()
    return runner


def chunks(model: Code2Wav, size: int, streams: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A call of `streams` chunks in slots 0, 1, ...: first chunks at frame 0, or later ones at every age (younger
    than the sliding window and long under way)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (streams, model.config.num_quantizers, size)
    codes = torch.randint(0, model.config.codebook_size, shape, generator=generator, device="cuda")
    ages = torch.randint(1, 200, (streams,), generator=generator, device="cuda") * (size != FIRST)
    return codes, ages, torch.arange(streams, device="cuda")


def seed_slots(decoder: ChunkDecoder, seed: int) -> None:
    """Every slot holding an earlier chunk's numbers, the same for a seed."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for t in (decoder.state.keys, decoder.state.values, *decoder.state.tails):
        t.copy_(torch.randn(t.shape, generator=generator, device="cuda"))


def test_every_graph_captured_and_priced(model, runner):
    assert (
        runner.captured_buckets
        == runner.buckets
        == [(s, b) for s in (FIRST, CHUNK) for b in (1, 2, 4, 8, 16)]
    )
    assert set(runner.graph_bytes) == set(runner.buckets)
    costs = runner.graph_costs(runner.buckets)
    assert set(costs) == set(runner.buckets) and all(0 < c.kept < c.bytes for c in costs.values())
    assert costs[(CHUNK, 16)].bytes > costs[(FIRST, 16)].bytes > costs[(FIRST, 1)].bytes
    assert costs[(CHUNK, 16)].kept > costs[(FIRST, 16)].kept  # the waveform: 25 frames against 2


def _ms(fn, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("size", [FIRST, CHUNK])
@pytest.mark.parametrize("streams", [1, 3, 16])
@torch.inference_mode()
def test_replay_equals_eager(model, runner, size, streams):
    codes, starts, slots = chunks(model, size, streams, seed=streams * 100 + size)
    decoder = runner.step
    assert runner.bucket_for(streams, (size,)) is not None
    seed_slots(decoder, 0)
    got = runner(codes, starts, slots)
    # eager over the same padded batch (zero codes, frame 0, the scratch slot): the kernels the graph
    # recorded, so only replay differs. Padding itself is shown exact in float32 on the CPU
    # (tests/unit/engine/graphs/test_code2wav_graphs.py): in bf16 a batch of 3 and one of 4 take other GEMM
    # kernels, which random weights amplify to ~5% here.
    pad = runner.bucket_for(streams, (size,))[-1] - streams
    padded = (
        torch.cat([codes, codes.new_zeros(pad, *codes.shape[1:])]),
        torch.cat([starts, starts.new_zeros(pad)]),
        torch.cat([slots, slots.new_full((pad,), decoder.scratch)]),
    )
    seed_slots(decoder, 0)
    want = decoder(*padded)[:streams]
    assert got.shape == want.shape == (streams, model.config.samples_per_frame * size)
    assert got.isfinite().all()
    error = _rel(got, want)
    eager, replay = _ms(lambda: decoder(codes, starts, slots)), _ms(lambda: runner(codes, starts, slots))
    print(
        f"{streams} streams x {size} frames: rel err {error:.2e}, eager {eager:.2f} ms, graph {replay:.2f} ms"
    )
    assert error < 2e-2  # bf16: a padded batch may take other kernels, so other rounding


@torch.inference_mode()
def test_a_result_outlives_later_replays(model, runner):
    """The waveform returned is a copy: replays of another graph in the pool, and of its own, leave it."""
    first = runner(*chunks(model, CHUNK, 3, seed=1))
    kept = first.clone()
    runner(*chunks(model, FIRST, 16, seed=2))
    runner(*chunks(model, CHUNK, 4, seed=3))
    torch.cuda.synchronize()
    assert torch.equal(first, kept)
