import copy

import pytest
import torch

from omnistage.models.loader import fill_random_
from omnistage.models.qwen3_omni.code2wav import Code2Wav, lookahead_samples
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder, Code2WavStreamer
from omnistage.models.qwen3_omni.config import Code2WavConfig

# The released upsampling path (1920 samples per frame, 555 of look-ahead) at toy widths. What the chunks
# hold is checked against the one-shot decode in tests/parity/test_code2wav_parity.py; here, their bookkeeping.
CONFIG = Code2WavConfig(
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
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


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    model = Code2Wav(CONFIG)
    fill_random_(model, seed=0)
    return model.eval()


def codes(frames: int) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.codebook_size, (CONFIG.num_quantizers, frames), generator=torch.Generator().manual_seed(0)
    )


def test_streamer_chunk_lengths(model):
    """First chunk small, later ones full, the rest at finish; samples total the one-shot length."""
    streamer = Code2WavStreamer(model, first_chunk=1, chunk=3)
    spf, lookahead = CONFIG.samples_per_frame, lookahead_samples(CONFIG)
    streamer.open("a")
    assert streamer.step() == []
    streamer.feed("a", codes(5))
    lengths = []
    for _ in range(3):
        lengths += [(len(out.samples), out.final) for out in streamer.step()]
    assert lengths == [(spf - lookahead, False), (3 * spf, False)]
    streamer.finish("a")
    lengths = [(len(out.samples), out.final) for out in streamer.step()]
    assert lengths == [(spf, True)]
    assert streamer.step() == []
    assert spf - lookahead + 3 * spf + spf == model.num_samples(5)


def test_streamer_finish_on_a_chunk_boundary_and_empty(model):
    streamer = Code2WavStreamer(model, first_chunk=2, chunk=2)
    streamer.open("full")
    streamer.open("empty")
    streamer.feed("full", codes(2))
    assert [(o.request_id, o.final) for o in streamer.step()] == [("full", False)]
    streamer.finish("full")
    streamer.finish("empty")
    outs = streamer.step()
    assert sorted((o.request_id, len(o.samples), o.final) for o in outs) == [
        ("empty", 0, True),
        ("full", 0, True),
    ]
    assert streamer.step() == []


def test_streamer_cancel_and_misuse(model):
    streamer = Code2WavStreamer(model, first_chunk=1, chunk=2)
    streamer.open("x")
    streamer.feed("x", codes(3))
    streamer.cancel("x")
    assert streamer.step() == []
    with pytest.raises(KeyError):
        streamer.feed("x", codes(1))
    streamer.open("y")
    with pytest.raises(ValueError, match="already open"):
        streamer.open("y")
    streamer.finish("y")
    with pytest.raises(ValueError, match="finished"):
        streamer.feed("y", codes(1))
    with pytest.raises(ValueError, match="chunk"):
        Code2WavStreamer(model, first_chunk=0, chunk=2)
    with pytest.raises(ValueError, match="slots"):
        Code2WavStreamer(model, slots=0)


def test_streamer_calls_the_decode_it_is_given(model):
    """A decode callable (a graph runner, in serving) runs every call in place of the streamer's own, with each
    chunk's frames, its stream's position and slot, and the chunks are cut from what it returns."""
    calls = []
    own = ChunkDecoder(model, slots=2)

    def decode(chunks, starts, slots):
        calls.append((tuple(chunks.shape), starts.tolist(), slots.tolist()))
        return -own(chunks, starts, slots)

    plain = Code2WavStreamer(model, first_chunk=1, chunk=2, slots=2)
    given = Code2WavStreamer(model, first_chunk=1, chunk=2, slots=2, decode=decode)
    for streamer in (plain, given):
        streamer.open("a")
        streamer.feed("a", codes(3))
        streamer.finish("a")
    expected = [plain.step(), plain.step()]
    got = [given.step(), given.step()]
    quantizers = CONFIG.num_quantizers
    assert calls == [((1, quantizers, 1), [0], [0]), ((1, quantizers, 2), [1], [0])]
    for want, out in zip(expected, got, strict=True):
        assert [(o.request_id, o.final) for o in out] == [(o.request_id, o.final) for o in want]
        torch.testing.assert_close(out[0].samples, -want[0].samples)


def run(streamer: Code2WavStreamer, frames: dict[str, int], cancel: str | None = None) -> dict[str, list]:
    """Open every stream, feed each its frames and finish it, cancel `cancel` after the first step, and step
    to the end: each stream's chunks, with the step each came in."""
    for i, (request_id, n) in enumerate(frames.items()):
        streamer.open(request_id)
        streamer.feed(request_id, codes(n + i)[:, i:])
        streamer.finish(request_id)
    chunks: dict[str, list] = {request_id: [] for request_id in frames}
    step = 0
    while streamer.streams:
        for out in streamer.step():
            chunks[out.request_id].append((step, out.samples))
        if step == 0 and cancel is not None:
            streamer.cancel(cancel)
        step += 1
    return chunks


def test_streams_beyond_the_slots_wait_for_one(model):
    """With one slot, three streams take turns in the order they opened, each decoding to what it does with a
    slot each (float64: batched apart or together, equal up to rounding); a cancelled stream gives its slot
    back."""
    model = copy.deepcopy(model).double()
    frames = {"a": 5, "b": 3, "c": 4}
    free = run(Code2WavStreamer(model, first_chunk=1, chunk=2, slots=3), frames)
    assert [[s for s, _ in free[r]] for r in frames] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    one = Code2WavStreamer(model, first_chunk=1, chunk=2, slots=1)
    taking_turns = run(one, frames)
    assert [[s for s, _ in taking_turns[r]] for r in frames] == [[0, 1, 2], [3, 4], [5, 6, 7]]
    for request_id in frames:
        for (_, got), (_, want) in zip(taking_turns[request_id], free[request_id], strict=True):
            torch.testing.assert_close(got, want)
    assert one.free == [0]
    cancelled = run(Code2WavStreamer(model, first_chunk=1, chunk=2, slots=1), frames, cancel="a")
    assert [[s for s, _ in cancelled[r]] for r in frames] == [[0], [1, 2], [3, 4, 5]]
