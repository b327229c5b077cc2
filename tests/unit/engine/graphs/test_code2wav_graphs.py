"""Code2Wav's graph runner on the CPU, where capture binds eager calls over the same static buffers: the
padded calls give what the decoder gives and leave the streams' slots as it does, and a streamer driven
through the runner gives the same chunks."""

import pytest
import torch

from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.models.loader import fill_random_
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder, Code2WavStreamer
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


class Recording(ChunkDecoder):
    """A chunk decoder that records the rows of its calls."""

    def __init__(self, model: Code2Wav, slots: int) -> None:
        super().__init__(model, slots)
        self.rows: list[int] = []

    def __call__(self, codes, starts, slots):
        self.rows.append(codes.shape[0])
        return super().__call__(codes, starts, slots)


def chunks(size: int, starts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call of len(starts) streams in slots 0, 1, ...: each a chunk of `size` frames at its start."""
    shape = (len(starts), CONFIG.num_quantizers, size)
    codes = torch.randint(0, CONFIG.codebook_size, shape, generator=torch.Generator().manual_seed(seed))
    return codes, torch.tensor(starts), torch.arange(len(starts))


def states(decoder: ChunkDecoder, seed: int) -> None:
    """Every slot, scratch included, holding earlier streams' numbers."""
    generator = torch.Generator().manual_seed(seed)
    for t in (decoder.state.keys, decoder.state.values, *decoder.state.tails):
        t.copy_(torch.randn(t.shape, generator=generator))


@pytest.mark.parametrize("size", [FIRST, CHUNK])
@torch.no_grad()
def test_padded_call_is_the_decoders(model, size):
    """3 streams (a new one, a young one, an old one) in the bucket of 4: the samples and the streams' slots
    after the call are the decoder's own, and the padding row wrote only the scratch slot."""
    decoder, plain = Recording(model, slots=3), ChunkDecoder(model, 3)
    runner = Code2WavGraphs(decoder, (FIRST, CHUNK), max_streams=4)
    assert runner.capture() == [(FIRST, 1), (FIRST, 2), (FIRST, 4), (CHUNK, 1), (CHUNK, 2), (CHUNK, 4)]
    runner.buffers.codes[size].fill_(CONFIG.codebook_size - 1)  # stale rows from an earlier call
    runner.buffers.starts[size].fill_(7)
    runner.buffers.slots[size].fill_(0)
    states(decoder, seed=size)
    states(plain, seed=size)
    codes, starts, slots = chunks(size, [0, 0, 0] if size == FIRST else [0, 3, 40], seed=size)
    decoder.rows.clear()
    got = runner(codes, starts, slots)
    assert decoder.rows == [4]
    want = plain(codes, starts, slots)
    assert got.shape == want.shape == (3, CONFIG.samples_per_frame * size)
    assert want.abs().max() < 1
    torch.testing.assert_close(got, want)
    # the streams' slots 0..2, not the scratch slot 3; float32 of a batch of 3 and of 4, each to its scale
    mine, theirs = decoder.state, plain.state
    for got_slots, want_slots in zip(
        (mine.keys[:, :3], mine.values[:, :3], *(t[:3] for t in mine.tails)),
        (theirs.keys[:, :3], theirs.values[:, :3], *(t[:3] for t in theirs.tails)),
        strict=True,
    ):
        torch.testing.assert_close(got_slots, want_slots, rtol=0, atol=1e-5 * want_slots.abs().max().item())


@torch.no_grad()
def test_calls_no_graph_fits_run_eagerly(model):
    decoder = Recording(model, slots=4)
    runner = Code2WavGraphs(decoder, (FIRST, CHUNK), max_streams=4)
    runner.capture([(CHUNK, 2)])
    assert runner.captured_buckets == [(CHUNK, 2)]
    for (size, streams), called in ((CHUNK, 1), 2), ((CHUNK, 3), 3), ((FIRST, 1), 1), ((7, 2), 2):
        call = chunks(size, [0] * streams if size == FIRST else list(range(streams)), seed=streams)
        states(decoder, seed=0)
        decoder.rows.clear()
        got = runner(*call)
        assert decoder.rows[0] == called
        states(decoder, seed=0)
        torch.testing.assert_close(got, ChunkDecoder.__call__(decoder, *call))
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


def test_streamer_through_the_runner_equals_plain(model):
    """Five streams, at most 3 a call: calls of 1 to 3 streams in buckets of 1, 2 and 4, both chunk sizes."""
    lengths, rates = [31, 9, 60, 27, 2], [3, 2, 5, 4, 2]
    eager = Recording(model, slots=5)
    plain = stream(Code2WavStreamer(model, FIRST, CHUNK, max_batch=3, slots=5, decode=eager), lengths, rates)
    decoder = Recording(model, slots=5)
    runner = Code2WavGraphs(decoder, (FIRST, CHUNK), max_streams=4)
    runner.capture()
    graphed = stream(
        Code2WavStreamer(model, FIRST, CHUNK, max_batch=3, slots=5, decode=runner), lengths, rates
    )
    assert 3 in eager.rows and sorted(set(decoder.rows)) == [
        b if b != 3 else 4 for b in sorted(set(eager.rows))
    ]
    for i in range(len(lengths)):
        assert len(graphed[i]) == len(plain[i]) > 0
        for got, want in zip(graphed[i], plain[i], strict=True):
            torch.testing.assert_close(got, want)
