"""The SnakeBeta kernel (kernels/snake.py) on the CPU through Triton's interpreter, against the formula in
float64 with the absent samples zeroed and the left pad, as `CausalConv1d` feeds its conv; and the torch path
of `code2wav_vocoder.SnakeBeta` (what the CPU runs) against the same reference."""

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

from omnistage.models.qwen3_omni.code2wav_vocoder import SnakeBeta

pytest.importorskip("triton")

CHANNELS, LENGTH = 5, 37
# per row b, samples before the stream began: none, mid-row, all but the row's last sample, and past the end
# (the whole row absent)
ABSENT = [0, 12, 36, 48]


def case(batch: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[batch, CHANNELS, LENGTH]` around the sizes the vocoder sees, and logarithmic α, β around 0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, CHANNELS, LENGTH, generator=g) * 3).to(dtype)
    log_alpha = (torch.randn(CHANNELS, generator=g) * 0.5).to(dtype)
    log_beta = (torch.randn(CHANNELS, generator=g) * 0.5).to(dtype)
    return x, log_alpha, log_beta


def reference(x, log_alpha, log_beta, pad, absent):
    """The formula in float64 on the inputs' values, then the absent samples zeroed, then the pad."""
    x64 = x.double()
    a, b = log_alpha.double().exp()[:, None], log_beta.double().exp()[:, None]
    y = x64 + torch.sin(x64 * a) ** 2 / (b + 1e-9)
    if absent is not None:
        present = torch.arange(x.shape[-1]) >= absent[:, None]
        y = torch.where(present[:, None, :], y, 0)
    return torch.nn.functional.pad(y, (pad, 0))


def with_absent_poisoned(x: torch.Tensor, absent: torch.Tensor) -> torch.Tensor:
    """x with its absent samples nan and inf: what they hold must not matter (a select, not a product)."""
    x = x.clone()
    for row, samples in enumerate(absent.tolist()):
        x[row, :, :samples] = float("nan")
        x[row, 0, :samples] = float("inf")
    return x


if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

    @pytest.mark.parametrize("pad", [0, 6])
    @pytest.mark.parametrize("masked", [False, True])
    def test_the_torch_path_is_the_reference(pad, masked):
        """Off CUDA SnakeBeta computes in torch, activation, zeroing and pad in that order."""
        x, log_alpha, log_beta = case(len(ABSENT), torch.float64, seed=pad)
        absent = torch.tensor(ABSENT) if masked else None
        if masked:
            x = with_absent_poisoned(x, absent)
        act = SnakeBeta(CHANNELS).double()
        with torch.no_grad():
            act.alpha.copy_(log_alpha)
            act.beta.copy_(log_beta)
            got = act(x, pad, absent)
        torch.testing.assert_close(
            got, reference(x, log_alpha, log_beta, pad, absent), rtol=1e-12, atol=1e-12
        )

else:
    patch_interpreter()
    # the interpreter's numpy warns on the poisoned absent samples, which the kernel then drops
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in sin:RuntimeWarning")

    from omnistage.kernels.snake import snake

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("pad", [0, 6, 150])  # 150: a padded row wider than the smallest block
    @pytest.mark.parametrize("masked", [False, True])
    def test_snake_is_the_formula_zeroed_and_padded(dtype, pad, masked):
        x, log_alpha, log_beta = case(len(ABSENT), dtype, seed=pad + masked)
        absent = torch.tensor(ABSENT) if masked else None
        if masked:
            x = with_absent_poisoned(x, absent)
        got = snake(x, log_alpha, log_beta, pad, absent)
        assert got.dtype == dtype and got.shape == (len(ABSENT), CHANNELS, pad + LENGTH)
        want = reference(x, log_alpha, log_beta, pad, absent)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        else:
            # the kernel computes in float32 and rounds once, to nearest on a GPU, toward zero in the
            # interpreter: either way its bf16 is within one ulp (2^-8 to 2^-7 of the value) of the reference
            # rounded to nearest
            torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2**-7, atol=1e-5)
        assert (got[..., :pad] == 0).all()
        if masked:
            for row, samples in enumerate(ABSENT):
                assert (got[row, :, pad : pad + samples] == 0).all()

    def test_a_row_strided_view_as_a_transposed_conv_trims_it():
        """A `TrimmedConvTranspose1d` output is a slice of a longer row: unit stride along the row only."""
        x, log_alpha, log_beta = case(3, torch.float32, seed=7)
        wide = torch.randn(3, CHANNELS, LENGTH + 8)
        wide[..., 4 : 4 + LENGTH] = x
        view = wide[..., 4 : 4 + LENGTH]
        assert not view.is_contiguous()
        absent = torch.tensor([0, 8, 80])
        got = snake(view, log_alpha, log_beta, 6, absent)
        torch.testing.assert_close(
            got.double(), reference(x, log_alpha, log_beta, 6, absent), rtol=1e-5, atol=1e-5
        )

    def test_a_row_longer_than_a_block():
        """Rows of several blocks: every block finds its own columns, the absent boundary in a later block."""
        g = torch.Generator().manual_seed(3)
        x = torch.randn(2, 3, 2500, generator=g)
        log_alpha, log_beta = torch.randn(3, generator=g) * 0.5, torch.randn(3, generator=g) * 0.5
        absent = torch.tensor([0, 1200])  # past the first block of 1,024
        got = snake(x, log_alpha, log_beta, 6, absent)
        torch.testing.assert_close(
            got.double(), reference(x, log_alpha, log_beta, 6, absent), rtol=1e-5, atol=1e-5
        )
