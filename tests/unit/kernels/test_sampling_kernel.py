"""`kernels/sampling.py` on the CPU through Triton's interpreter (tests/triton_interpreter.py): the one
kernel draws what `static_sampling.sample_torch` draws, id for id, and advances the draw numbers alike.

The interpreter has no libdevice, so here the kernel's expf/logf are torch's CPU exp/log, the functions the
torch path calls on the CPU (on the GPU both call the CUDA math library's): what is tested is that every
other step, ranks, masses, top-p, noise and race, gives the torch path's bits."""

import math

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import ReduceOps, TensorHandle

    from omnistage.engine.static_sampling import StaticRows, sample_torch
    from omnistage.kernels.sampling import sample_kernel

    def _torch_elementwise(fn):
        def call(x):
            data = fn(torch.from_numpy(x.handle.data)).numpy()
            return tl.tensor(TensorHandle(data, x.handle.dtype.scalar), x.type)

        return call

    libdevice.exp = _torch_elementwise(torch.exp)
    libdevice.log = _torch_elementwise(torch.log)

    def _reduce_xor_at_once(apply_impl):
        """tl.topk swaps pairs through xor_sum, which the interpreter reduces one element at a time in Python
        (~0.1 s a row at vocabulary 256); numpy's xor reduction gives the same bits at once."""

        def call(self, input):
            if self.combine_fn != tl.standard._xor_combine:
                return apply_impl(self, input)
            data = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(data, input[0].dtype)

        return call

    ReduceOps.apply_impl = _reduce_xor_at_once(ReduceOps.apply_impl)

    def random_case(g: torch.Generator, batch: int, vocab: int, rows: int | None = None):
        """Logits (half the cases bf16-rounded: ties, as the code predictor's lm_head gives) and settings with
        greedy and sampled rows mixed, top-p on and off, temperatures from 0.3 to 1.5; `rows` pads."""
        scale = float(torch.empty(()).uniform_(0.5, 4.0, generator=g))
        logits = torch.randn(batch, vocab, generator=g) * scale
        if torch.rand((), generator=g) < 0.5:
            logits = logits.bfloat16().float()
        settings = StaticRows.empty(rows or batch, "cpu")
        settings.fill(
            (torch.rand(batch, generator=g) < 0.3).tolist(),
            torch.tensor([0.3, 0.7, 1.0, 1.5])[torch.randint(0, 4, (batch,), generator=g)].tolist(),
            torch.where(
                torch.rand(batch, generator=g) < 0.5, torch.rand(batch, generator=g), math.inf
            ).tolist(),
            torch.randint(-(2**62), 2**62, (batch,), generator=g).tolist(),
            torch.randint(0, 10_000, (batch,), generator=g).tolist(),
        )
        return logits, settings

    def copy(rows: StaticRows) -> StaticRows:
        return StaticRows(
            *(t.clone() for t in (rows.greedy, rows.temperature, rows.top_p, rows.seeds, rows.draws))
        )

    def assert_same_draws(logits: torch.Tensor, rows: StaticRows, top_k: int, calls: int = 1) -> torch.Tensor:
        """Both paths `calls` times from copies of `rows`: the same ids and draw numbers after every call, the
        batch's draw numbers `calls` on, the padding's as they were; the kernel's ids `[calls, B]`."""
        by_kernel, by_torch = copy(rows), copy(rows)
        ids = []
        for _ in range(calls):
            ids.append(sample_kernel(logits, by_kernel, top_k))
            assert torch.equal(ids[-1], sample_torch(logits, by_torch, top_k))
            assert torch.equal(by_kernel.draws, by_torch.draws)
        batch = logits.shape[0]
        assert torch.equal(by_kernel.draws[:batch], rows.draws[:batch] + calls)
        assert torch.equal(by_kernel.draws[batch:], rows.draws[batch:])
        return torch.stack(ids)

    @pytest.mark.parametrize(("batch", "cases"), [(1, 8), (2, 4), (5, 2), (13, 1), (64, 1)])
    def test_the_kernel_draws_what_the_torch_path_draws(batch, cases):
        g = torch.Generator().manual_seed(batch)
        for _ in range(cases):
            logits, rows = random_case(g, batch, vocab=256)
            assert_same_draws(logits, rows, top_k=50)

    @pytest.mark.parametrize(
        ("vocab", "top_k"), [(256, 1), (256, 7), (256, 64), (256, 256), (200, 50), (48, 40)]
    )
    def test_any_top_k_and_vocabulary(vocab, top_k):
        g = torch.Generator().manual_seed(vocab + top_k)
        logits, rows = random_case(g, 6, vocab, rows=8)  # padded: the kernel reads only the batch's rows
        assert_same_draws(logits, rows, top_k)

    def test_successive_calls_draw_anew_and_greedy_rows_take_the_argmax():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(4, 256, generator=g).bfloat16().float()
        rows = StaticRows.empty(4, "cpu")
        rows.fill(
            [True, False, False, False], [1.0, 1.0, 0.7, 1.3], [1.0, 0.9, 1.0, 0.5], [1, 2, 3, 4], [0] * 4
        )
        ids = assert_same_draws(logits, rows, 50, calls=6)
        assert (ids[:, 0] == logits[0].argmax()).all()  # the lowest id of a tie, as torch's argmax
        assert all(len(set(ids[:, b].tolist())) > 1 for b in range(1, 4))

    def test_released_vocabulary():
        g = torch.Generator().manual_seed(2048)
        logits, rows = random_case(g, 2, vocab=2048)
        rows.greedy[:2] = torch.tensor([False, True])
        assert_same_draws(logits, rows, top_k=50, calls=2)
