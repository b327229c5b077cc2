"""Code2Wav's graph runner on the CPU, where capture binds eager calls over the same static buffers: the
padded calls give what `decode_window` gives, and a streamer driven through the runner the same chunks."""

import pytest
import torch

from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.models.loader import fill_random_
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_streamer import Code2WavStreamer
from omnistage.models.qwen3_omni.config import Code2WavConfig

# The released upsampling path (1920 samples per frame) at toy widths, two layers of a 3-frame window
CONFIG = Code2WavConfig(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    codebook_size=32,
    num_quantizers=2,
    decoder_dim=16,
    sliding_window=3,
    upsample_rates=(8, 5, 4, 3),
    upsampling_ratios=(2, 2),
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
FIRST, CHUNK = 2, 25


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    model = Code2Wav(CONFIG)
    fill_random_(model, seed=0)
    # scaled down so that no sample reaches the ±1 clamp, where differences would hide
    model.decoder[-1].conv.weight.data /= 64
    model.decoder[-1].conv.bias.data /= 64
    return model.eval()


@pytest.fixture
def rows(model, monkeypatch) -> list[int]:
    """The rows of every decode_window call (the runner's bound one included, made after this fixture)."""
    calls = []
    decode_window = model.decode_window

    def recording(codes, starts):
        calls.append(codes.shape[0])
        return decode_window(codes, starts)

    monkeypatch.setattr(model, "decode_window", recording)
    return calls


def windows(model: Code2Wav, size: int, starts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (len(starts), CONFIG.num_quantizers, model.left_context + size)
    codes = torch.randint(0, CONFIG.codebook_size, shape, generator=torch.Generator().manual_seed(seed))
    return codes, torch.tensor(starts)


@pytest.mark.parametrize("size", [FIRST, CHUNK])
@torch.no_grad()
def test_padded_call_equals_decode_window(model, rows, size):
    """3 streams (a new one, one younger than the context, an old one) in the bucket of 4."""
    runner = Code2WavGraphs(model, (FIRST, CHUNK), max_streams=4)
    assert runner.capture() == [(FIRST, 1), (FIRST, 2), (FIRST, 4), (CHUNK, 1), (CHUNK, 2), (CHUNK, 4)]
    runner.buffers.codes[size].fill_(CONFIG.codebook_size - 1)  # stale rows from an earlier call
    runner.buffers.starts[size].fill_(-7)
    codes, starts = windows(model, size, [-model.left_context, 3 - model.left_context, 40], seed=size)
    rows.clear()
    got = runner(codes, starts)
    assert rows == [4]
    want = model.decode_window(codes, starts)
    assert got.shape == want.shape == (3, CONFIG.samples_per_frame * size)
    assert want.abs().max() < 1
    torch.testing.assert_close(got, want)


@torch.no_grad()
def test_calls_no_graph_fits_run_eagerly(model, rows):
    runner = Code2WavGraphs(model, (FIRST, CHUNK), max_streams=4)
    runner.capture([(CHUNK, 2)])
    assert runner.captured_buckets == [(CHUNK, 2)]
    for (size, streams), called in ((CHUNK, 1), 2), ((CHUNK, 3), 3), ((FIRST, 1), 1), ((7, 2), 2):
        codes, starts = windows(model, size, list(range(streams)), seed=streams)
        rows.clear()
        torch.testing.assert_close(runner(codes, starts), model.decode_window(codes, starts))
        assert rows[0] == called
    with pytest.raises(ValueError, match="chunk size"):
        runner.capture([(7, 1)])


def stream(streamer: Code2WavStreamer, lengths: list[int], rates: list[int]) -> dict[int, list[torch.Tensor]]:
    """Stream i is fed rates[i] frames a tick until it has lengths[i]: chunks fall due together or apart."""
    generator = torch.Generator().manual_seed(1)
    chunks: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(lengths))}
    for i in chunks:
        streamer.open(i)
    fed, done = [0] * len(lengths), set()
    while len(done) < len(lengths):
        for i, (length, rate) in enumerate(zip(lengths, rates, strict=True)):
            k = min(rate, length - fed[i])
            if k:
                frames = torch.randint(
                    0, CONFIG.codebook_size, (CONFIG.num_quantizers, k), generator=generator
                )
                streamer.feed(i, frames)
                fed[i] += k
                if fed[i] == length:
                    streamer.finish(i)
        for out in streamer.step():
            chunks[out.request_id].append(out.samples)
            done |= {out.request_id} if out.final else set()
    return chunks


def test_streamer_through_the_runner_equals_plain(model, rows):
    """Five streams, at most 3 a call: calls of 1 to 3 streams in buckets of 1, 2 and 4, both chunk sizes."""
    lengths, rates = [31, 9, 60, 27, 2], [3, 2, 5, 4, 2]
    plain = stream(Code2WavStreamer(model, FIRST, CHUNK, max_batch=3), lengths, rates)
    eager_rows = sorted(set(rows))
    runner = Code2WavGraphs(model, (FIRST, CHUNK), max_streams=4, prefix=FIRST)
    assert runner.buffers.codes[FIRST].shape[-1] == FIRST  # a first chunk's window: its frames alone
    runner.capture()
    rows.clear()
    graphed = stream(Code2WavStreamer(model, FIRST, CHUNK, max_batch=3, decode=runner), lengths, rates)
    assert 3 in eager_rows and sorted(set(rows)) == [bucket if bucket != 3 else 4 for bucket in eager_rows]
    for i in range(len(lengths)):
        assert len(graphed[i]) == len(plain[i]) > 0
        for got, want in zip(graphed[i], plain[i], strict=True):
            torch.testing.assert_close(got, want)
