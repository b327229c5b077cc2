"""The largest media requests against an engine's memory plan: one request per image size and clip length.

Starts the engine in this process with the given settings (by default random weights at the released
sizes on the GPU, whose memory plan counts the encoders' peaks on the largest inputs the processor
admits), then sends one request per input with a forced short answer and reports, per request, whether it
succeeded, its wall time and the peak of `torch.cuda.max_memory_allocated` during it, with the plan table.

    python benchmarks/large_inputs.py --gpu-memory-limit-gib 80 --out large_inputs.json
    python benchmarks/large_inputs.py --device cpu --tiny --images 64x64 --clips 1.5   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage import LLM, SamplingParams
from omnistage.bench.clips import speech_like
from omnistage.bench.skeletons import released_skeleton

log = logging.getLogger("large_inputs")

IMAGES = ("448x448", "1920x1080", "2560x1440", "3840x2160")
CLIPS = (180.0, 290.0)


def picture(size: str, seed: int) -> Image.Image:
    """Random RGB noise of `size` ("WxH"): the encoder's cost depends on the pixel count only."""
    width, height = map(int, size.split("x"))
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def one_request(llm: LLM, name: str, part: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    """Run one chat request with `part` and a question; what happened, how long, and the memory peak."""
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
    cuda = llm.engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result: dict[str, Any] = {"input": name, "ok": False, "error": None}
    try:
        out = llm.chat(messages, params)[0]
        result.update(
            ok=True, prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.outputs[0].token_ids)
        )
    except Exception as exc:  # an out-of-memory error is a result here, not the end of the run
        result["error"] = f"{type(exc).__name__}: {exc}"
        if cuda:
            torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - start
    result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: released sizes with dummy weights)")
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint (a smoke run)")
    parser.add_argument("--load-format", default="dummy", choices=["safetensors", "dummy"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gpu-memory-limit-gib", type=float)
    parser.add_argument("--num-kv-pages", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--images", nargs="*", default=list(IMAGES), help="image sizes, WxH")
    parser.add_argument("--clips", nargs="*", type=float, default=list(CLIPS), help="clip lengths in seconds")
    parser.add_argument("--output-tokens", type=int, default=8, help="forced answer length (ignore_eos)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    model = None if args.tiny else args.model or str(released_skeleton())
    settings = dict(
        device=args.device, dtype=args.dtype, load_format="safetensors" if args.tiny else args.load_format,
        gpu_memory_limit_gib=args.gpu_memory_limit_gib, num_kv_pages=args.num_kv_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    started = time.perf_counter()
    llm = LLM(model=model, **{k: v for k, v in settings.items() if v is not None})
    engine = llm.engine
    plan = engine.plan.table() if engine.plan else engine.memory_summary()
    print(plan)
    params = SamplingParams(max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True)
    inputs = [
        (f"image {size}", {"type": "image", "image": picture(size, i)}) for i, size in enumerate(args.images)
    ]
    inputs += [
        (f"audio {seconds:g} s", {"type": "audio", "audio": speech_like(seconds, i).astype(np.float32)})
        for i, seconds in enumerate(args.clips)
    ]
    requests = []
    for name, part in inputs:
        result = one_request(llm, name, part, params)
        peak = result["max_memory_allocated_gib"]
        print(
            f"{name:<16} {'ok' if result['ok'] else 'FAILED':<6} {result['seconds']:7.2f} s"
            f"{f'  peak {peak:6.2f} GiB' if peak is not None else ''}"
            f"{'  ' + result['error'] if result['error'] else ''}"
        )
        requests.append(result)
    results = {
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": settings | {"model": model, "output_tokens": args.output_tokens},
        "engine_start_s": time.perf_counter() - started - sum(r["seconds"] for r in requests),
        "plan": plan,
        "requests": requests,
        "all_ok": all(r["ok"] for r in requests),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    raise SystemExit(0 if main()["all_ok"] else 1)
