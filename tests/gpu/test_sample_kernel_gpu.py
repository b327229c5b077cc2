"""The compiled sampling kernel (kernels/sampling.py) at the code predictor's released sizes: the same ids
and draw numbers as static_sampling's torch path, called eagerly and replayed in a captured CUDA graph."""

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnistage.engine.static_sampling import StaticRows, sample_static, sample_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV, VOCAB, TOP_K, STEPS = (
    "cuda",
    2048,
    50,
    15,
)  # the released code predictor's codebook, top_k and inner steps


def settings(batch: int, seed: int) -> StaticRows:
    """Greedy and sampled rows mixed, top-p on and off, temperatures 0.3 to 1.5, random seeds and draws."""
    g = torch.Generator().manual_seed(seed)
    rows = StaticRows.empty(batch, DEV)
    rows.fill(
        (torch.rand(batch, generator=g) < 0.3).tolist(),
        torch.tensor([0.3, 0.7, 1.0, 1.5])[torch.randint(0, 4, (batch,), generator=g)].tolist(),
        torch.where(torch.rand(batch, generator=g) < 0.5, torch.rand(batch, generator=g), math.inf).tolist(),
        torch.randint(-(2**62), 2**62, (batch,), generator=g).tolist(),
        torch.randint(0, 10_000, (batch,), generator=g).tolist(),
    )
    return rows


def step_logits(batch: int, seed: int) -> torch.Tensor:
    """`[STEPS, batch, VOCAB]` float32 logits, bf16-rounded as the lm_head gives them (ties included)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(STEPS, batch, VOCAB, generator=g, device=DEV) * 3).bfloat16().float()


def copy(rows: StaticRows) -> StaticRows:
    return StaticRows(
        *(t.clone() for t in (rows.greedy, rows.temperature, rows.top_p, rows.seeds, rows.draws))
    )


@pytest.mark.parametrize("batch", [1, 2, 8, 33, 64])
def test_the_kernel_draws_what_the_torch_path_draws(batch):
    from omnistage.kernels.sampling import sample_kernel

    rows = settings(batch, seed=batch)
    by_kernel, by_torch = copy(rows), copy(rows)
    for logits in step_logits(batch, seed=batch):
        assert torch.equal(sample_kernel(logits, by_kernel, TOP_K), sample_torch(logits, by_torch, TOP_K))
        assert torch.equal(by_kernel.draws, by_torch.draws)
    assert torch.equal(by_kernel.draws, rows.draws + STEPS)


def test_a_captured_frame_of_draws_replays_the_torch_path():
    """A graph of 15 `sample_static` calls, replayed twice: each replay draws what the torch path draws from
    the draw numbers the last one left (the counters advance on the device)."""
    batch = 64
    rows = settings(batch, seed=7)
    first_draws = rows.draws.clone()
    logits = step_logits(batch, seed=7)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernel outside the capture
        sample_static(logits[0], rows, TOP_K)
    torch.cuda.current_stream().wait_stream(side)
    rows.draws.copy_(first_draws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = torch.stack([sample_static(step, rows, TOP_K) for step in logits])
    by_torch = copy(rows)
    for replay in range(2):
        graph.replay()
        want = torch.stack([sample_torch(step, by_torch, TOP_K) for step in logits])
        assert torch.equal(ids, want), f"replay {replay}"
        assert torch.equal(rows.draws, first_draws + STEPS * (replay + 1))


@triton.jit
def _math_kernel(x_ptr, y_ptr, exp_ptr, log_ptr, div_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=1.0)
    y = tl.load(y_ptr + offsets, mask=mask, other=1.0)
    tl.store(exp_ptr + offsets, libdevice.exp(x), mask=mask)
    tl.store(log_ptr + offsets, libdevice.log(y), mask=mask)
    tl.store(div_ptr + offsets, tl.math.div_rn(x, y), mask=mask)


def test_the_kernels_float_operations_are_torchs():
    """What makes the draws bit-equal: libdevice's expf and logf and `div_rn` in Triton give torch's exp, log
    and division bit for bit. Exp's inputs as the kernel's, <= 0, down to -60: a weight below e**-28 is no
    integer mass, one below e**-20 cannot win a race (down there Triton flushes denormals, torch does not)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    n = 1 << 22
    x = -torch.rand(n, generator=g, device=DEV) * 60
    y = torch.rand(n, generator=g, device=DEV).clamp_min(2**-24)
    exp, log, div = (torch.empty_like(x) for _ in range(3))
    _math_kernel[(triton.cdiv(n, 1024),)](x, y, exp, log, div, n, BLOCK=1024)
    assert torch.equal(exp, x.exp())
    assert torch.equal(log, y.log())
    assert torch.equal(div, x / y)


def test_a_kernel_that_cannot_build_falls_back_to_the_same_draws_in_torch(monkeypatch, caplog):
    import omnistage.engine.static_sampling as static_sampling
    import omnistage.kernels.sampling as sample_kernel_module

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel on this build")

    monkeypatch.setattr(sample_kernel_module, "sample_kernel", broken)
    monkeypatch.setattr(static_sampling, "_kernel_failed", False)
    logits = torch.randn(4, VOCAB, device=DEV)
    ours, theirs = settings(4, 7), settings(4, 7)
    with caplog.at_level("ERROR", logger="omnistage.engine.static_sampling"):
        ids = sample_static(logits, ours, TOP_K)
    assert torch.equal(ids, sample_torch(logits, theirs, TOP_K)) and torch.equal(ours.draws, theirs.draws)
    assert static_sampling._kernel_failed and "sampling kernel failed" in caplog.text
