"""The host's share of admitting one Qwen3-ASR prompt, outside the tower: its prefix keys and its placeholder rows.

    python benchmarks/admission_host.py                    # this tree
    PYTHONPATH=.ab python benchmarks/admission_host.py     # the tree `before_after.sh export REV` put in .ab/

A wave of 128 transcriptions at c=128 is admitted in one call of the engine's thread while the Thinker waits
(benchmarks/RESULTS.md, "Where the 0.6B's time goes at c=128"), so each prompt's host work counts 128 times.
Times `PageKeys.of_prompt` (16-row pages, its audio rows' bytes hashed) and `EncoderStage._place` (on the CPU:
without the device copy) on a prompt of the released 0.6B's shape: 80 ids, 60 audio rows of 1,024 bf16 values.
Prints the best of `--repeats` runs of `--calls` calls each, in µs a call.
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable

import numpy as np
import torch

import omnistage
from omnistage.engine.prefix_keys import MediaRows, PageKeys
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.vision_rows import VisionRows

AUDIO_TOKEN = 151676  # Qwen3-ASR's <|audio_pad|>
IDS = [151644] * 10 + [AUDIO_TOKEN] * 60 + [198] * 10
ROWS = np.arange(10, 70)


def best_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    values = np.random.default_rng(0).integers(0, 256, (len(ROWS), 2048), dtype=np.uint8)
    media = (MediaRows(ROWS, values),)
    stage = object.__new__(EncoderStage)  # only what _place reads
    stage.audio = types.SimpleNamespace(token_id=AUDIO_TOKEN)
    stage.images = stage.videos = None
    stage.device = torch.device("cpu")
    audio = torch.zeros(len(ROWS), 1024, dtype=torch.bfloat16)
    timed = {
        "prefix keys (PageKeys.of_prompt)": lambda: PageKeys.of_prompt(IDS, 16, media=media),
        "placeholder rows (EncoderStage._place)": lambda: stage._place(IDS, audio, VisionRows()),
    }
    print(f"omnistage from {omnistage.__file__}")
    for name, fn in timed.items():
        fn()
        print(f"{name}: {best_us(fn, args.calls, args.repeats):.1f} µs a call")


if __name__ == "__main__":
    main()
