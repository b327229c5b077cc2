"""Where a Code2Wav chunk call's time goes at the released sizes (random bf16), on the GPU machine:

    python benchmarks/code2wav_profile.py --streams 16,32,64 --out $OUT/code2wav_profile.json

For each number of streams, one call of 25-frame chunks (`Code2Wav.decode_chunk`, every stream long under
way, as at c=64 after the first packets, each in its state slot) timed, medians of `--repeats` after warm-up, each between CUDA
synchronisations: the whole call, its transformer part and its vocoder part (upsamplers, ConvNeXt blocks and
the conv decoder) as the model runs them (SnakeBeta on its Triton kernel, `kernels/snake.py`); the vocoder on
torch's passes (`code2wav.torch_snake`, every conv on cuDNN); that torch path compiled by torch.compile at the
fixed shape; and the vocoder with every conv on cuDNN in its benchmark mode (each algorithm timed, not guessed).
Beside them the largest difference of the kernel's samples and of the compiled ones from the eager torch
path's. The last conv is scaled down first, as the GPU tests do: with random weights most samples would sit
at the ±1 clamp, where differences hide; its dilated convs take the polyphase form where the server's start-up
would put them (`code2wav_convs.adopt_polyphase`). Then the eager call at the first count under torch.profiler: its
CUDA kernels with the most total time, and its convolutions with the most by input shapes. Prints a table;
writes everything to --out.

    python benchmarks/code2wav_profile.py --flops

counts instead, on any machine (the meta device: no weights, no GPU), a call's GFLOP per stream with torch's
FLOP counter, for chunks of 1 to 50 frames.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.code2wav import Code2Wav, StreamSlots
from omnistage.models.qwen3_omni.code2wav_convs import adopt_polyphase
from omnistage.models.qwen3_omni.code2wav_transformer import KeyValues
from omnistage.models.qwen3_omni.code2wav_vocoder import CausalConv1d, torch_snake
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config

CHUNK = 25


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median ms of `fn` between synchronisations, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, StreamSlots]


def inputs(model: Code2Wav, streams: int) -> Call:
    """A call of 25-frame chunks, every stream long under way (nothing absent), each in its slot."""
    device = model.code_embedding.weight.device
    generator = torch.Generator(device=device).manual_seed(streams)
    shape = (streams, model.config.num_quantizers, CHUNK)
    codes = torch.randint(0, model.config.codebook_size, shape, generator=generator, device=device)
    slots = torch.arange(streams, device=device)
    return codes, torch.full((streams,), 1000, device=device), slots, StreamSlots.allocate(model, streams)


def keep_inside_clamp(model: Code2Wav) -> None:
    """The last conv scaled down so that few samples reach the ±1 clamp, where differences would hide."""
    last = model.decoder[-1].conv
    last.weight.data /= 64
    last.bias.data /= 64


@contextmanager
def cudnn_convs(model: Code2Wav) -> Iterator[None]:
    """Every conv of `model` on cuDNN inside the block (none in the polyphase form): torch's own path, which
    torch.compile also compiles (inductor fails on the polyphase form's reshapes, torch 2.11)."""
    phased = [m for m in model.modules() if isinstance(m, CausalConv1d) and m.polyphase]
    for m in phased:
        m.polyphase = False
    try:
        yield
    finally:
        for m in phased:
            m.polyphase = True


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def profile(model: Code2Wav, streams: int, repeats: int) -> dict[str, Any]:
    call = inputs(model, streams)
    codes, first, slots, state = call
    past = KeyValues(state.keys[:, slots], state.values[:, slots])
    with torch.inference_mode():
        # the vocoder alone: over the chunk's frames, as a call runs it less its carried samples' copies
        hidden, _ = model.pre_transformer(model.embed(codes), first, past)
        fused = model.vocode(hidden)
        row = {
            "streams": streams,
            "call_ms": timed(lambda: model.decode_chunk(*call), repeats),
            "transformer_ms": timed(lambda: model.pre_transformer(model.embed(codes), first, past), repeats),
            "vocoder_ms": timed(lambda: model.vocode(hidden), repeats),
        }
        # the compiled vocoder is the torch path's: dynamo guards on the activations' `fused`, so it is
        # compiled and called inside the same block
        with torch_snake(model), cudnn_convs(model):
            eager = model.vocode(hidden)
            compiled_vocode = torch.compile(model.vocode, dynamic=False)
            compiled = compiled_vocode(hidden)
            row["vocoder_torch_ms"] = timed(lambda: model.vocode(hidden), repeats)
            row["vocoder_compiled_ms"] = timed(lambda: compiled_vocode(hidden), repeats)
        # cuDNN times its algorithms per shape
        with cudnn_convs(model), torch.backends.cudnn.flags(enabled=True, benchmark=True):
            row["vocoder_cudnn_benchmark_ms"] = timed(lambda: model.vocode(hidden), repeats)
        row["fused_max_abs_diff"] = max_abs_diff(fused, eager)
        row["compiled_max_abs_diff"] = max_abs_diff(compiled, eager)
    return row


def top_kernels(model: Code2Wav, streams: int, top: int) -> list[dict[str, Any]]:
    call = inputs(model, streams)
    with torch.inference_mode():
        model.decode_chunk(*call)
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.decode_chunk(*call)
            sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return [
        {"name": e.key[:100], "count": e.count, "total_ms": round(e.device_time_total / 1e3, 3)}
        for e in events[:top]
    ]


def top_convolutions(model: Code2Wav, streams: int, top: int) -> list[dict[str, Any]]:
    """The convolutions of one eager call with the most CUDA time, by their input shapes: which layer a slow
    kernel of `top_kernels` belongs to."""
    call = inputs(model, streams)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.inference_mode():
        model.decode_chunk(*call)
        sync()
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            model.decode_chunk(*call)
            sync()
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::convolution"]
    events.sort(key=lambda e: -e.device_time_total)
    return [
        {"shapes": str(e.input_shapes[:3]), "count": e.count, "total_ms": round(e.device_time_total / 1e3, 3)}
        for e in events[:top]
    ]


def flops() -> list[dict[str, Any]]:
    """GFLOP a stream of one call, per chunk size, at the released sizes on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    with torch.device("meta"):
        model = Code2Wav(cfg).to(torch.bfloat16)
    state, start = StreamSlots.allocate(model, 1), torch.full((1,), 100, device="meta")
    rows = []
    for frames in (1, 2, 12, 25, 50):
        codes = torch.zeros(1, cfg.num_quantizers, frames, dtype=torch.long, device="meta")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.decode_chunk(codes, start, torch.zeros_like(start), state)
        rows.append({"frames": frames, "gflop": counter.get_total_flops() / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="16,32,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("code2wav_profile.json"))
    parser.add_argument("--flops", action="store_true", help="count a call's GFLOP instead (no GPU needed)")
    args = parser.parse_args()
    if args.flops:
        print("| chunk frames | GFLOP a stream |\n| --- | --- |")
        for row in flops():
            print(f"| {row['frames']} | {row['gflop']:.1f} |")
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # adopt_polyphase's times per conv
    cfg = Qwen3OmniConfig.from_dict(released_config()).code2wav
    model = load_model(lambda: Code2Wav(cfg), ".", "code2wav.",
                       LoadOptions(torch.bfloat16, "cuda", load_format="dummy"))  # fmt: skip
    keep_inside_clamp(model)
    counts = [int(s) for s in args.streams.split(",")]
    phased = adopt_polyphase(model, 16, CHUNK)  # as the server does at start-up (16 streams a call)
    print(f"dilated convs in the polyphase form: {phased}")
    rows = [profile(model, streams, args.repeats) for streams in counts]
    kernels = top_kernels(model, counts[0], args.top)
    convolutions = top_convolutions(model, counts[0], 8)
    print("| streams | call ms | transformer ms | vocoder ms | vocoder torch ms | vocoder compiled ms "
          "| vocoder, cuDNN benchmark ms | kernel max diff | compiled max diff |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['streams']} | {r['call_ms']:.2f} | {r['transformer_ms']:.2f} | {r['vocoder_ms']:.2f} | "
              f"{r['vocoder_torch_ms']:.2f} | {r['vocoder_compiled_ms']:.2f} | "
              f"{r['vocoder_cudnn_benchmark_ms']:.2f} | {r['fused_max_abs_diff']:.2e} | "
              f"{r['compiled_max_abs_diff']:.2e} |")  # fmt: skip
    print(f"\nTop CUDA kernels, one eager call of {counts[0]} streams:")
    for k in kernels:
        print(f"  {k['total_ms']:8.3f} ms  {k['count']:4d}x  {k['name']}")
    print(f"\nTop convolutions by input shapes (input, weight, bias), one eager call of {counts[0]} streams:")
    for c in convolutions:
        print(f"  {c['total_ms']:8.3f} ms  {c['count']:4d}x  {c['shapes']}")
    out = {"chunk": CHUNK, "rows": rows, "top_kernels": kernels, "top_convolutions": convolutions}
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
