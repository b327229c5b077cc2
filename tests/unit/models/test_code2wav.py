import pytest
import torch

from omnistage.models.loader import fill_random_
from omnistage.models.qwen3_omni.code2wav import (
    Code2Wav,
    decoder_left_context,
    lookahead_samples,
    transformer_left_context,
)
from omnistage.models.qwen3_omni.code2wav_convs import adopt_polyphase, polyphase_conv
from omnistage.models.qwen3_omni.config import Code2WavConfig, Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config

# The released upsampling path (1920 samples per frame) at toy widths; a 3-frame window over 2 layers.
CONFIG = Code2WavConfig(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    codebook_size=64,
    num_quantizers=4,
    decoder_dim=16,
    sliding_window=3,
    upsample_rates=(8, 5, 4, 3),
    upsampling_ratios=(2, 2),
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    """float64, so that equalities by design show as such (1e-12) rather than as float32 rounding."""
    model = Code2Wav(CONFIG)
    fill_random_(model, seed=0)
    with torch.no_grad():
        model.decoder[-1].conv.weight.mul_(1e-2)  # keep samples inside the ±1 clamp, where changes show
    return model.double().eval()


def codes(frames: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.codebook_size, (1, CONFIG.num_quantizers, frames), generator=generator)


def test_left_context_of_the_released_config():
    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    assert transformer_left_context(cfg) == 8 * 71
    assert decoder_left_context(cfg) == 10
    assert lookahead_samples(cfg) == 555
    with torch.device("meta"):
        assert Code2Wav(cfg).left_context == 578


@torch.no_grad()
def test_decoder_left_context_is_exact(model):
    """The first sample a chunk starting at frame `a` emits reads transformer frame a - D, and nothing earlier."""
    frames, start = 24, 17
    context = decoder_left_context(CONFIG)
    hidden = torch.randn(
        1, frames, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    base = model.vocode(hidden)[0]
    first = CONFIG.samples_per_frame * start - lookahead_samples(CONFIG)

    def perturbed(frame: int) -> torch.Tensor:
        changed = hidden.clone()
        changed[0, frame] += 1.0
        return model.vocode(changed)[0]

    outside = perturbed(start - context - 1)
    assert torch.equal(outside[first:], base[first:])
    assert perturbed(start - context)[first] != base[first]


@torch.no_grad()
def test_transformer_left_context_is_exact(model):
    """A frame's code reaches the transformer's output up to L·(W-1) frames later, and no further."""
    frames, frame = 16, 3
    reach = transformer_left_context(CONFIG)
    base_codes = codes(frames)
    positions = torch.arange(frames)[None]
    base = model.pre_transformer(model.embed(base_codes), positions)[0]
    changed_codes = base_codes.clone()
    changed_codes[0, :, frame] = (changed_codes[0, :, frame] + 1) % CONFIG.codebook_size
    changed = model.pre_transformer(model.embed(changed_codes), positions)[0]
    moved = (changed - base).abs().amax(-1) > 0
    assert moved.nonzero().flatten().tolist() == list(range(frame, frame + reach + 1))


@torch.no_grad()
def test_decode_window_equals_one_shot_samples(model):
    """A window of left context + chunk yields exactly the one-shot samples of the chunk's frames, also when
    the window reaches before the stream's start (absent frames stand as the convolutions' zero padding)."""
    frames, chunk = 30, 3
    context = model.left_context
    all_codes = codes(frames, seed=2)
    one_shot = model(all_codes)[0]
    spf, lookahead = CONFIG.samples_per_frame, lookahead_samples(CONFIG)
    starts = [0, 2, context - 1, context + 4, frames - chunk]
    windows = []
    for a in starts:
        window = all_codes[0, :, max(0, a - context) : a + chunk]
        windows.append(torch.nn.functional.pad(window, (context + chunk - window.shape[-1], 0)))
    out = model.decode_window(torch.stack(windows), torch.tensor(starts) - context)
    assert out.shape == (len(starts), spf * chunk)
    for row, a in enumerate(starts):
        lo, hi = spf * a - lookahead, spf * (a + chunk) - lookahead
        expected = one_shot[max(lo, 0) : hi]
        got = out[row, max(lo, 0) - lo :]
        assert (got - expected).abs().max() <= 1e-12 * one_shot.abs().max()


@pytest.mark.parametrize("dilation", [2, 3, 9])
@pytest.mark.parametrize("length", [990, 1000, 1001])
def test_polyphase_conv_is_torchs_dilated_conv(dilation, length):
    """A dilated conv as one undilated conv over its phases gives torch's conv1d, to float32's reduction
    order, whether or not the output's length is whole phases."""
    generator = torch.Generator().manual_seed(length + dilation)
    x = torch.randn(2, 24, length + 6 * dilation, generator=generator)
    weight = torch.randn(16, 24, 7, generator=generator) / 10
    bias = torch.randn(16, generator=generator)
    got = polyphase_conv(x, weight, bias, dilation)
    want = torch.nn.functional.conv1d(x, weight, bias, dilation=dilation)
    assert got.shape == want.shape == (2, 16, length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_adopt_polyphase_puts_the_convs_it_measured_faster_on_it(model):
    """With a fake timer that finds the polyphase form faster for every other dilated conv (and by less than
    the margin for the rest), just those take it, and the window decodes to the same samples."""
    window, first = codes(model.left_context + 3, seed=5), torch.tensor([40])
    want = model.decode_window(window, first)
    calls = []

    def timer(call):
        call()
        calls.append(call)
        if len(calls) % 2:  # the conv as it is
            return 1.0
        return 0.5 if len(calls) % 4 == 2 else 0.9  # polyphase: well faster, then within the margin

    try:
        adopted = adopt_polyphase(model, streams=1, chunk=3, timer=timer)
        dilated = [n for n, m in model.named_modules() if getattr(m, "polyphase", None) is not None]
        dilated = [n for n in dilated if model.get_submodule(n).conv.dilation[0] > 1]
        assert len(calls) == 2 * len(dilated) and len(dilated) == 8  # 4 blocks, dilations 3 and 9 each
        assert adopted == dilated[::2]
        assert all(model.get_submodule(n).polyphase == (n in adopted) for n in dilated)
        torch.testing.assert_close(model.decode_window(window, first), want, rtol=0, atol=1e-12)
    finally:
        for m in model.modules():
            if getattr(m, "polyphase", None):
                m.polyphase = False
