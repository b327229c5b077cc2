"""`engine/race_kernel.py` on the CPU through Triton's interpreter (tests/triton_interpreter.py): the one
kernel draws what `static_sampling`'s torch path draws, and advances the draw numbers alike."""

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    from omnistage.engine.race_kernel import race
    from omnistage.engine.static_sampling import uniform_noise

    @pytest.mark.parametrize("k", [50, 64, 7])
    def test_race_draws_what_the_torch_path_draws(k):
        g = torch.Generator().manual_seed(k)
        batch = 33
        probs = torch.rand(batch, k, generator=g).softmax(dim=-1)
        probs[::3, k // 2 :] = 0.0  # rows cut by top-p
        seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
        draws = torch.randint(0, 10_000, (batch,), generator=g)
        want = (probs / -uniform_noise(seeds, draws, k).log()).argmax(dim=-1)
        advanced = draws.clone()
        got = race(probs, seeds, advanced)
        assert torch.equal(got, want)
        assert torch.equal(advanced, draws + 1)
        # the next draw of the same rows differs (the counter moved) and is again the torch path's
        again = race(probs, seeds, advanced)
        assert torch.equal(again, (probs / -uniform_noise(seeds, draws + 1, k).log()).argmax(dim=-1))
        assert not torch.equal(again, got)
