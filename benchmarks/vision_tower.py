"""What the vision tower costs per video frame pair by how many of them one call holds, at the released sizes
(random bf16), on the GPU machine:

    python benchmarks/vision_tower.py --out $OUT/vision_tower.json

A 1280x720 video frame pair resizes to 40 x 72 patches of 16 pixels (2,880 patches, 720 Thinker rows). For
t = 1, 2, 4, 8, 17 (the most one call of the largest image's 50,176 patches holds) and 30 temporal patches in
one eager call of the tower (`VisionEncoder.forward`, FlashAttention varlen within each frame pair): the
median ms of the call after warm-up, the ms per frame pair, its peak memory above the weights, and the GEMMs'
TFLOP/s (2 x the blocks' and mergers' weights x patches; attention not counted). Then a 30 s video (30 frame
pairs) encoded as 30 calls of one pair, 15 of two, 8 of four and 2 of 15: the ways the encoder stage may cut it. Then
the kernels with the most CUDA time in one call of 8 pairs (torch.profiler). With `--compile`, the same
tables again after `VisionEncoder.compile_regions()` (what a GPU server runs), with the first compiled call's
seconds and its output's distance from the eager one's. Prints the tables; writes everything to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder

GRID_H, GRID_W = 40, 72  # a 1280x720 frame pair after the processor's resize (640x1152 pixels)
PAIRS = (1, 2, 4, 8, 17, 30)
WHOLE = 30  # a 30 s video at 2 fps: 60 frames, 30 pairs


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median ms of `fn` between synchronisations, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def patches(tower: VisionEncoder, pairs: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    width = tower.patch_embed.proj.weight[0].numel()  # C x T x P x P
    values = torch.randn(pairs * GRID_H * GRID_W, width, device="cuda", dtype=torch.bfloat16)
    return values, [(pairs, GRID_H, GRID_W)]


def gemm_flops(tower: VisionEncoder, patches: int) -> float:
    """2 x weights x rows for the blocks (every patch) and the mergers (a quarter of the rows, 4x wider)."""
    blocks = sum(p.numel() for b in tower.blocks for p in b.parameters() if p.dim() == 2)
    mergers = sum(
        p.numel() for m in [tower.merger, *tower.merger_list] for p in m.parameters() if p.dim() == 2
    )
    return 2.0 * (blocks * patches + mergers * patches / 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("vision_tower.json"))
    parser.add_argument(
        "--compile", action="store_true", help="then the same with the blocks compiled (compile_regions)"
    )
    args = parser.parse_args()
    cfg = Qwen3OmniConfig.from_dict(released_config()).thinker.vision
    torch.manual_seed(0)
    tower = VisionEncoder(cfg).to("cuda", torch.bfloat16).eval()
    for p in tower.parameters():
        p.data.normal_(0, 0.02)
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "grid": [GRID_H, GRID_W]}
    with torch.inference_mode():
        probe = patches(tower, 8)
        reference = tower(*probe)[0]
        result["eager"] = sweep(tower, args.repeats)
        if args.compile:
            tower.compile_regions()
            started = time.perf_counter()
            compiled = tower(*probe)[0]
            torch.cuda.synchronize()
            result["compile_s"] = time.perf_counter() - started
            difference = (compiled.float() - reference.float()).abs()
            result["compiled_vs_eager"] = {
                "max_abs": difference.max().item(),
                "mean_abs": difference.mean().item(),
                "mean_abs_eager": reference.float().abs().mean().item(),
            }
            print(
                f"\ncompiled: first call {result['compile_s']:.1f} s; 8 pairs against eager {result['compiled_vs_eager']}"
            )
            result["compiled"] = sweep(tower, args.repeats)
        tower(*probe)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower(*probe)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    result["top_kernels_8_pairs"] = table
    print("\n" + table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def sweep(tower: VisionEncoder, repeats: int) -> dict[str, Any]:
    """The per-call table and the whole video's ways, printed and returned."""
    weights = torch.cuda.memory_allocated()
    result: dict[str, Any] = {"calls": [], "whole": []}
    print(
        "\n| frame pairs in one call | patches | call ms | ms per pair | peak GiB above weights | GEMM TFLOP/s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for pairs in PAIRS:
        values, grid = patches(tower, pairs)
        torch.cuda.reset_peak_memory_stats()
        ms = timed(lambda values=values, grid=grid: tower(values, grid), repeats)
        peak = (torch.cuda.max_memory_allocated() - weights) / 2**30
        tflops = gemm_flops(tower, len(values)) / ms / 1e9
        row = {"pairs": pairs, "patches": len(values), "ms": ms, "peak_gib": peak, "gemm_tflops": tflops}
        result["calls"].append(row)
        print(f"| {pairs} | {len(values):,} | {ms:.1f} | {ms / pairs:.2f} | {peak:.2f} | {tflops:.0f} |")
        del values
    print(f"\n| a {WHOLE}-pair video as | calls | ms |\n| --- | --- | --- |")
    for per in (1, 2, 4, 15):
        pieces = [patches(tower, min(per, WHOLE - first)) for first in range(0, WHOLE, per)]
        ms = timed(lambda pieces=pieces: [tower(v, g) for v, g in pieces], repeats)
        result["whole"].append({"pairs_per_call": per, "calls": len(pieces), "ms": ms})
        print(f"| {per} pair(s) a call | {len(pieces)} | {ms:.1f} |")
        del pieces
    return result


if __name__ == "__main__":
    main()
