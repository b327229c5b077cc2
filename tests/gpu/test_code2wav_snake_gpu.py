"""The SnakeBeta kernel (kernels/snake.py) on a GPU: alone at the vocoder's largest shape against the formula;
in Code2Wav at the released sizes (random weights), `decode_chunk` with it against torch's passes
(`code2wav.torch_snake`) in float32 and in bf16; and a captured graph's replay, which must record the kernel
reading each call's absent frames, against an eager call. Then the dilated convs that start-up measures faster
in the polyphase form (`code2wav_convs.adopt_polyphase`): the form alone against cuDNN in float32, and
`decode_chunk` with them against the float32 model, eagerly and through a graph."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav import Code2Wav, StreamSlots
from omnistage.models.qwen3_omni.code2wav_convs import adopt_polyphase, polyphase_conv
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder
from omnistage.models.qwen3_omni.code2wav_vocoder import CausalConv1d, torch_snake
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
FIRST, CHUNK, STREAMS = 2, 25, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextmanager
def ieee_convs() -> Iterator[None]:
    """float32 convolutions in float32: cuDNN takes them as TF32 by default, hardly finer than bf16."""
    precision = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cudnn.conv.fp32_precision = precision


def released(dtype: torch.dtype) -> Code2Wav:
    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    return load_model(lambda: Code2Wav(cfg), ".", "code2wav.", LoadOptions(dtype, DEV, load_format="dummy"))


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    model = released(torch.bfloat16)
    # scaled down so that few samples reach the ±1 clamp, where differences would hide
    model.decoder[-1].conv.weight.data /= 64
    model.decoder[-1].conv.bias.data /= 64
    return model


@pytest.fixture(scope="module")
def reference(model) -> Code2Wav:
    """The same weights in float32, on torch's passes: the oracle both bf16 paths are measured against. Loaded
    as such, then given the bf16 model's values: `.float()` would leave the fused projections' weights (plain
    attributes viewing the parameters' storage, `layers/linear.py`) in bf16."""
    reference = released(torch.float32)
    reference.load_state_dict(model.state_dict())
    return reference


Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def call(model: Code2Wav, size: int, seed: int) -> Call:
    """A call of STREAMS chunks in slots 0, 1, ...: first chunks (at frame 0), or later chunks, half of them
    their streams' first (whose convolutions then zero the samples before the stream's start, through the
    kernel), the others younger than the sliding window or long under way."""
    generator = torch.Generator(device=DEV).manual_seed(seed)
    shape = (STREAMS, model.config.num_quantizers, size)
    codes = torch.randint(0, model.config.codebook_size, shape, generator=generator, device=DEV)
    ages = torch.randint(1, 200, (STREAMS,), generator=generator, device=DEV)
    ages[: STREAMS // 2] = 0
    return codes, ages * (size != FIRST), torch.arange(STREAMS, device=DEV)


def seeded(state: StreamSlots, seed: int = 0) -> StreamSlots:
    """`state` holding earlier chunks' numbers: the same in every dtype for a seed."""
    generator = torch.Generator(device=DEV).manual_seed(seed)
    for t in (state.keys, state.values, *state.tails):
        t.copy_(torch.randn(t.shape, generator=generator, device=DEV))
    return state


def decode(model: Code2Wav, chunks: Call) -> torch.Tensor:
    """`chunks` decoded eagerly from seeded slots."""
    return model.decode_chunk(*chunks, seeded(StreamSlots.allocate(model, STREAMS)))


def snake_reference(x, log_alpha, log_beta, pad, absent):
    """The formula in float64, then the absent samples zeroed, then the pad."""
    x64 = x.double()
    a, b = log_alpha.double().exp()[:, None], log_beta.double().exp()[:, None]
    y = x64 + torch.sin(x64 * a) ** 2 / (b + 1e-9)
    present = torch.arange(x.shape[-1], device=x.device) >= absent[:, None]
    return torch.nn.functional.pad(torch.where(present[:, None, :], y, 0), (pad, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_the_kernel_at_the_largest_shape(dtype):
    """The last decoder block's `[16, 96, 48,000]` at a 25-frame chunk, its 7-tap conv's pad of 6, rows with
    no absent sample, some (a first chunk's 555), all but one, and all; the absent samples poisoned with nan."""
    from omnistage.kernels.snake import snake

    g = torch.Generator(device=DEV).manual_seed(0)
    channels, length = 96, 25 * 1920
    x = (torch.randn(STREAMS, channels, length, generator=g, device=DEV) * 3).to(dtype)
    log_alpha = (torch.randn(channels, generator=g, device=DEV) * 0.5).to(dtype)
    log_beta = (torch.randn(channels, generator=g, device=DEV) * 0.5).to(dtype)
    absent = torch.tensor([0, 1, 555, length - 1, length, 2 * length] + [7] * (STREAMS - 6), device=DEV)
    present = torch.arange(length, device=DEV) >= absent[:, None]
    x = torch.where(present[:, None, :], x, float("nan"))
    got = snake(x, log_alpha, log_beta, 6, absent)
    want = snake_reference(x, log_alpha, log_beta, 6, absent)
    assert got.dtype == dtype and got.shape == (STREAMS, channels, 6 + length)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        # one rounding of a float32 result: within one bf16 ulp (2^-8 to 2^-7 of the value) of the reference
        # rounded to bf16
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("size", [FIRST, CHUNK])
@torch.inference_mode()
def test_decode_chunk_with_the_kernel_is_torchs(model, reference, size):
    """In float32 the kernel's path gives torch's samples to float32's rounding: every activation's pad,
    zeroed absent frames and strides are as torch's. In bf16 the kernel computes in float32 and rounds once,
    where torch rounds each of its passes: its samples are no farther from the float32 model's than torch's are
    (both are far, and by how much depends on how random weights amplify bf16's rounding, so the bound is
    torch's own error rather than a fixed figure)."""
    chunks = call(model, size, seed=size)
    with ieee_convs():
        exact = decode(reference, chunks)
        with torch_snake(reference):
            want = decode(reference, chunks)
    fused = decode(model, chunks)
    with torch_snake(model):
        eager = decode(model, chunks)
    assert fused.shape == eager.shape == want.shape == (STREAMS, model.config.samples_per_frame * size)
    assert fused.isfinite().all()
    assert not torch.equal(fused, eager) and not torch.equal(exact, want)  # two paths ran, in each dtype
    fused_error, eager_error = _rel(fused, want), _rel(eager, want)
    print(
        f"{STREAMS} streams x {size} frames, against torch in float32: kernel in float32 "
        f"{_rel(exact, want):.2e}; in bf16 kernel {fused_error:.2e}, torch {eager_error:.2e}, kernel against "
        f"torch {_rel(fused, eager):.2e}"
    )
    assert _rel(exact, want) < 1e-4
    assert fused_error <= 1.25 * eager_error


def graphs(model: Code2Wav, buckets: list[tuple[int, int]]) -> Code2WavGraphs:
    runner = Code2WavGraphs(ChunkDecoder(model, STREAMS), (FIRST, CHUNK), STREAMS)
    runner.capture(buckets)
    return runner


def replayed(runner: Code2WavGraphs, chunks: Call) -> torch.Tensor:
    """`chunks` through `runner`'s graph, from seeded slots."""
    seeded(runner.step.state)
    return runner(*chunks)


@pytest.fixture(scope="module")
def runner(model) -> Code2WavGraphs:
    return graphs(model, [(FIRST, STREAMS), (CHUNK, STREAMS)])


@pytest.mark.parametrize("size", [FIRST, CHUNK])
@torch.inference_mode()
def test_a_replay_is_an_eager_call(model, runner, size):
    """Two calls of other ages through one graph: each replay reads its own absent frames."""
    for seed in (1, 2):
        chunks = call(model, size, seed=seed)
        got = replayed(runner, chunks)
        want = decode(model, chunks)
        error = _rel(got, want)
        print(f"{STREAMS} streams x {size} frames: replay against eager {error:.2e}")
        # the graph recorded the eager call's kernels; as test_code2wav_graphs_gpu.py allows, bf16 rounding
        # may still differ where a library picks another kernel on the capture stream
        assert error < 2e-2


@torch.inference_mode()
def test_the_polyphase_form_is_cudnns_conv_in_float32():
    """The 384-channel conv of dilation 9 at a 16-stream 25-frame call's shape, where cuDNN's heuristics pick
    a slow kernel (benchmarks/RESULTS.md, "Under load, a fourth time")."""
    g = torch.Generator(device=DEV).manual_seed(9)
    x = torch.randn(STREAMS, 384, 5609, generator=g, device=DEV)
    weight = torch.randn(384, 384, 7, generator=g, device=DEV) / 50
    bias = torch.randn(384, generator=g, device=DEV)
    with ieee_convs():
        want = torch.nn.functional.conv1d(x, weight, bias, dilation=9)
        got = polyphase_conv(x, weight, bias, 9)
    assert got.shape == want.shape == (STREAMS, 384, 5555)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def polyphase(model) -> Iterator[list[str]]:
    """`model` with the dilated convs start-up would put in the polyphase form; as it was afterwards."""
    adopted = adopt_polyphase(model, STREAMS, CHUNK)
    try:
        yield adopted
    finally:
        for m in model.modules():
            if isinstance(m, CausalConv1d):
                m.polyphase = False


@torch.inference_mode()
def test_decode_chunk_with_polyphase_convs_is_cudnns(model, reference, polyphase):
    """In bf16 the polyphase convs' samples are no farther from the float32 model's than cuDNN's are; a graph
    captured with them replays its eager call."""
    print(f"in the polyphase form: {polyphase}")
    chunks = call(model, CHUNK, seed=7)
    with ieee_convs():
        want = decode(reference, chunks)
    phased = decode(model, chunks)
    for m in model.modules():
        if isinstance(m, CausalConv1d) and m.polyphase:
            m.polyphase = False
    plain = decode(model, chunks)
    for name in polyphase:
        model.get_submodule(name).polyphase = True
    print(f"against float32: polyphase {_rel(phased, want):.2e}, cuDNN {_rel(plain, want):.2e}")
    assert _rel(phased, want) <= 1.25 * _rel(plain, want)
    assert _rel(replayed(graphs(model, [(CHUNK, STREAMS)]), chunks), phased) < 2e-2
