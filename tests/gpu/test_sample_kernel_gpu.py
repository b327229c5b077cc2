"""The compiled race kernel draws what static_sampling's torch path draws, on the GPU."""

import pytest
import torch

from omnistage.engine.static_sampling import uniform_noise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_compiled_kernel_draws_as_the_torch_path():
    from omnistage.engine.race_kernel import race

    g = torch.Generator(device="cuda").manual_seed(0)
    batch, k = 64, 50
    probs = torch.rand(batch, k, generator=g, device="cuda").softmax(dim=-1)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g, device="cuda")
    draws = torch.randint(0, 10_000, (batch,), generator=g, device="cuda")
    want = (probs / -uniform_noise(seeds, draws, k).log()).argmax(dim=-1)
    advanced = draws.clone()
    assert torch.equal(race(probs, seeds, advanced), want)
    assert torch.equal(advanced, draws + 1)
