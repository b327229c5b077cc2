import pytest
import torch

from omnistage.models.loader import fill_random_
from omnistage.models.qwen3_omni.code2wav import Code2Wav, StreamSlots, lookahead_samples
from omnistage.models.qwen3_omni.code2wav_convs import adopt_polyphase, polyphase_conv
from omnistage.models.qwen3_omni.code2wav_transformer import KeyValues
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


def test_lookahead_and_state_of_the_released_config():
    """555 samples of look-ahead, and a stream's state: 8 layers' keys and values of 71 frames, and what each
    conv reads back (k − 1)·d samples of: the ConvNeXt blocks' and the decoder's first conv at 1,024
    channels, each block's residual convs at its channels, the last conv at 96; each decoder block's transposed
    conv, one input sample: 2.6 MB in bf16."""
    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    assert lookahead_samples(cfg) == 555
    with torch.device("meta"):
        state = StreamSlots.allocate(Code2Wav(cfg).to(torch.bfloat16), 4)
    assert state.keys.shape == state.values.shape == (8, 5, 16, 71, 64) and state.scratch == 4
    blocks = [[(c, 1), (c // 2, 6), (c // 2, 18), (c // 2, 54)] for c in (1536, 768, 384, 192)]
    carried = [(1024, 6)] * 3 + [shape for block in blocks for shape in block] + [(96, 6)]
    assert [tuple(t.shape) for t in state.tails] == [(5, c, k) for c, k in carried]
    assert state.nbytes == 5 * 2 * (2 * 8 * 16 * 71 * 64 + sum(c * k for c, k in carried))
    assert state.nbytes // 5 == 2_594_944


@torch.no_grad()
def test_transformer_over_chunks_with_kept_keys_is_one_shot(model):
    """Chunks of 5, 1 and 10 frames, each given the keys and values the chunk before kept, give the one-shot
    transformer's output; what the first chunk is given (keys before frame 0) changes nothing, whatever it is."""
    frames = 16
    hidden = model.embed(codes(frames, seed=3))
    want, _ = model.pre_transformer(hidden, torch.tensor([0]))
    shape = (CONFIG.num_hidden_layers, 1, CONFIG.num_key_value_heads, CONFIG.sliding_window - 1, 8)
    generator = torch.Generator().manual_seed(4)
    past = KeyValues(*(1e3 * torch.randn(shape, generator=generator, dtype=torch.float64) for _ in "kv"))
    got, start = [], 0
    for size in (5, 1, 10):
        out, past = model.pre_transformer(hidden[:, start : start + size], torch.tensor([start]), past)
        assert past.keys.shape == past.values.shape == shape
        got.append(out)
        start += size
    assert (torch.cat(got, dim=1) - want).abs().max() <= 1e-12 * want.abs().max()


@torch.no_grad()
def test_decode_chunk_is_the_one_shot_samples(model):
    """Three streams share calls at different positions, each in its slot, in chunks of 1, 3 and 2 frames (a
    1-frame chunk is shorter than some convs' reach back, whose carried samples then reach into the chunk
    before the last): every chunk's samples are the one-shot decode's, from each stream's first chunk to its
    last. The slots start with another stream's numbers, and a padding row writes the scratch slot."""
    frames, sizes = 24, (1, 3, 2)
    streams = [codes(frames, seed=10 + i)[0] for i in range(3)]
    one_shot = [model(c[None])[0] for c in streams]
    state = StreamSlots.allocate(model, 3)
    for t in (state.keys, state.values, *state.tails):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5), dtype=t.dtype))
    begins, slots = [0, 2, 5], [2, 0, 1]  # the call each stream's first chunk is in, its slot
    spf, lookahead = CONFIG.samples_per_frame, lookahead_samples(CONFIG)
    decoded, checked = [0, 0, 0], 0
    for call in range(20):
        size = sizes[call % 3]
        rows = [i for i in range(3) if call >= begins[i] and decoded[i] + size <= frames]
        if not rows:
            continue
        starts = [decoded[i] for i in rows]
        batch = torch.stack([streams[i][:, a : a + size] for i, a in zip(rows, starts, strict=True)])
        padded = torch.cat([batch, torch.zeros_like(batch[:1])])
        wav = model.decode_chunk(
            padded,
            torch.tensor([*starts, 0]),
            torch.tensor([*(slots[i] for i in rows), state.scratch]),
            state,
        )
        assert wav.shape == (len(rows) + 1, spf * size)
        for row, (i, a) in enumerate(zip(rows, starts, strict=True)):
            lo = spf * a - lookahead
            expected = one_shot[i][max(lo, 0) : lo + spf * size]
            got = wav[row, max(lo, 0) - lo :]
            assert (got - expected).abs().max() <= 1e-12 * one_shot[i].abs().max()
            decoded[i] += size
            checked += 1
    assert checked >= 30 and min(decoded) >= frames - 3


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
    chunk, first, slot = codes(3, seed=5), torch.tensor([40]), torch.tensor([0])
    want = model.decode_chunk(chunk, first, slot, StreamSlots.allocate(model, 1))
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
        got = model.decode_chunk(chunk, first, slot, StreamSlots.allocate(model, 1))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    finally:
        for m in model.modules():
            if getattr(m, "polyphase", None):
                m.polyphase = False
