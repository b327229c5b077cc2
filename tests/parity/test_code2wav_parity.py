"""Our Code2Wav against transformers' Qwen3OmniMoeCode2Wav on the same weights, on the CPU.

One-shot waveforms (batch of 2, before the final clamp) within 1e-5 of max |ref| in float64, and in float32 as
close as transformers' own float32 decode; streamed chunks concatenated equal the one-shot decode (1e-12 in
float64, float32 rounding in float32) for several chunk schedules and streams no chunk size divides.
"""

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.code2wav import load_code2wav
from omnistage.models.qwen3_omni.code2wav_streamer import ChunkDecoder, Code2WavStreamer
from omnistage.models.qwen3_omni.tiny import tiny_config
from omnistage.models.tiny_checkpoint import random_tensor

TOLERANCE = 1e-5


def variant_config() -> dict:
    """Two layers with a 4-frame window and GQA 2:1: the streamer's left context (2·3 + 10 = 16 frames) is
    shorter than the streams below, so chunks are decoded from a truncated history."""
    config = tiny_config()
    config["code2wav_config"].update(num_hidden_layers=2, sliding_window=4, num_key_value_heads=1)
    return config


def reference_model(config: dict):
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    code2wav_config = Qwen3OmniMoeConfig(**config).code2wav_config
    code2wav_config._attn_implementation = "eager"  # an attention path independent of ours (SDPA)
    return Qwen3OmniMoeCode2Wav(code2wav_config)


def write_variant(directory, config: dict, seed: int = 1):
    """A checkpoint holding only `code2wav.*` tensors (all that both loaders read), bf16 like the released one."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"code2wav.{name}": random_tensor(name, tuple(value.shape), generator).to(torch.bfloat16)
        for name, value in reference_model(config).state_dict().items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def load_reference(directory):
    model = reference_model(json.loads((directory / "config.json").read_text()))
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        state = {
            name.removeprefix("code2wav."): f.get_tensor(name).float()
            for name in f.keys()
            if name.startswith("code2wav.")
        }
    model.load_state_dict(state, strict=True)
    return model.float().eval()


@pytest.fixture(scope="module", params=["tiny", "variant"])
def models(request, tmp_path_factory) -> dict:
    """Ours and transformers' on the same (bf16) weights, in float32 and in float64."""
    if request.param == "tiny":
        directory = request.getfixturevalue("tiny_checkpoint")  # the session's shared one (conftest)
    else:
        directory = write_variant(tmp_path_factory.mktemp("code2wav-variant") / "ckpt", variant_config())
    theirs = load_reference(directory)
    return {
        "ours32": load_code2wav(directory, LoadOptions(torch.float32, "cpu")),
        "ours64": load_code2wav(directory, LoadOptions(torch.float64, "cpu")),
        "theirs32": theirs,
        "theirs64": copy.deepcopy(theirs).double(),
    }


def random_codes(model, batch: int, frames: int, seed: int) -> torch.Tensor:
    cfg = model.config
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, frames), generator=generator)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def unclamped(model, codes: torch.Tensor) -> torch.Tensor:
    """The waveform `[B, samples]` before the final ±1 clamp: random weights push most samples past it,
    where any two models would agree."""
    captured = []
    hook = model.decoder[-1].register_forward_hook(lambda module, args, out: captured.append(out[:, 0]))
    try:
        clamped = model(codes).reshape(len(codes), -1)
    finally:
        hook.remove()
    assert torch.equal(clamped, captured[0].clamp(-1, 1))
    return captured[0]


@pytest.mark.parametrize("frames", [1, 7, 26])
@torch.no_grad()
def test_one_shot_waveform(models, frames):
    """float64: within 1e-5 of max |ref| (both keep RMSNorm and RoPE in float32, the rest of the gap).
    float32: at most 3x as far from the float64 reference as transformers' own float32 decode is (a max over
    noise, hence the margin): on these random weights the decoder amplifies rounding ~50x, so transformers'
    float32 waveform is itself 1e-5..3e-5 of max from its float64 one."""
    codes = random_codes(models["ours32"], 2, frames, seed=frames)
    ref = unclamped(models["theirs64"], codes)
    assert ref.shape == (2, models["ours32"].num_samples(frames))
    error64 = relative_error(unclamped(models["ours64"], codes), ref)
    error32 = relative_error(unclamped(models["ours32"], codes), ref)
    their_error32 = relative_error(unclamped(models["theirs32"], codes), ref)
    print(
        f"{frames} frames: float64 {error64:.2e}; float32 ours {error32:.2e}, transformers {their_error32:.2e}"
    )
    assert error64 <= TOLERANCE
    assert error32 <= 3 * their_error32


LENGTHS = (23, 17, 26)  # frames of three streams; no chunk size below divides them all


def quiet(model):
    """A copy whose final conv is scaled down, so that no sample reaches the ±1 clamp."""
    model = copy.deepcopy(model)
    model.decoder[-1].conv.weight /= 64
    model.decoder[-1].conv.bias /= 64
    return model


def stream(model, codes: list[torch.Tensor], first_chunk: int, chunk: int) -> tuple[list[torch.Tensor], int]:
    """Each stream's chunks concatenated, and the most distinct stream positions one decode call batched.

    Streams open at ticks 0, 1, 2; the first is fed a frame per tick, the others all their frames at once
    (a backlog, one chunk per step), so decode calls batch streams at different positions."""
    decoder = ChunkDecoder(model, len(codes))
    positions = []

    def recording(frames, starts, slots):
        positions.append(len(starts.unique()))
        return decoder(frames, starts, slots)

    streamer = Code2WavStreamer(model, first_chunk, chunk, slots=len(codes), decode=recording)
    rates = [1] + [len(c[0]) for c in codes[1:]]
    audio: list[list[torch.Tensor]] = [[] for _ in codes]
    done, fed, tick = set(), [0] * len(codes), 0
    while len(done) < len(codes):
        for i, frames in enumerate(codes):
            if tick == i:
                streamer.open(i)
            if tick >= i and fed[i] < frames.shape[1]:
                streamer.feed(i, frames[:, fed[i] : fed[i] + rates[i]])
                fed[i] = min(frames.shape[1], fed[i] + rates[i])
                if fed[i] == frames.shape[1]:
                    streamer.finish(i)
        for out in streamer.step():
            audio[out.request_id].append(out.samples)
            if out.final:
                done.add(out.request_id)
        tick += 1
    return [torch.cat(chunks) for chunks in audio], max(positions)


@pytest.mark.parametrize("first_chunk,chunk", [(2, 4), (1, 8), (3, 5), (1, 1)])
@torch.no_grad()
def test_streamed_chunks_equal_one_shot(models, first_chunk, chunk):
    """float64: streamed == one-shot up to rounding (equal by design). float32: streaming adds no error beyond
    float32 rounding (at most 3x as far from the float64 one-shot as the float32 one-shot is)."""
    ours64, ours32 = quiet(models["ours64"]), quiet(models["ours32"])
    codes = [random_codes(ours64, 1, n, seed=100 + i)[0] for i, n in enumerate(LENGTHS)]
    streamed64, batched = stream(ours64, codes, first_chunk, chunk)
    streamed32, _ = stream(ours32, codes, first_chunk, chunk)
    assert batched > 1, "no decode call batched streams at different positions"
    error64 = error32 = one_shot_error32 = 0.0
    for frames, got64, got32 in zip(codes, streamed64, streamed32, strict=True):
        expected = ours64(frames[None])[0]
        assert got64.shape == got32.shape == expected.shape and expected.abs().max() < 1
        error64 = max(error64, relative_error(got64, expected))
        error32 = max(error32, relative_error(got32, expected))
        one_shot_error32 = max(one_shot_error32, relative_error(ours32(frames[None])[0], expected))
    print(
        f"chunks {first_chunk} then {chunk}: streamed vs one-shot float64 {error64:.2e}; "
        f"float32 streamed {error32:.2e}, one-shot {one_shot_error32:.2e}"
    )
    assert error64 <= 1e-12
    assert error32 <= 3 * one_shot_error32
