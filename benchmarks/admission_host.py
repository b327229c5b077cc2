"""The host's share of admitting one Qwen3-ASR prompt, outside the tower (its prefix keys and its placeholder
rows), and of a 30 s video's Talker prompt (its prefix keys and its positions).

    python benchmarks/admission_host.py                    # this tree
    PYTHONPATH=.ab python benchmarks/admission_host.py     # the tree `before_after.sh export REV` put in .ab/

A wave of 128 transcriptions at c=128 is admitted in one call of the engine's thread while the Thinker waits
(benchmarks/RESULTS.md, "Where the 0.6B's time goes at c=128"), so each prompt's host work counts 128 times.
Times `PageKeys.of_prompt` (16-row pages, its audio rows' bytes hashed) and `EncoderStage._place` (on the CPU:
without the device copy) on a prompt of the released 0.6B's shape: 80 ids, 60 audio rows of 1,024 bf16 values.
The hand-off keys a 30 s 720p video's Talker prompt (`talker_keys`: 22,013 rows, 21,989 of them the video's,
each 2,048 bf16 hidden values, with M-RoPE positions) and lays out its positions (`talker_positions`: 30
temporal patches of 720 rows merged with 389 of its sound track's, the released config's rules) between its
first text token and its first packet.
Prints the best of `--repeats` runs of `--calls` calls each (a hundredth of them for the video), in µs a call.
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable

import numpy as np
import torch

import omnistage
from omnistage.bench.skeletons import released_skeleton
from omnistage.engine.prefix_keys import MediaRows, PageKeys
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.vision_rows import VisionRows
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout, VideoLayout
from omnistage.models.qwen3_omni.talker_input import SpeechTokens, TalkerPrompt, talker_positions
from omnistage.models.qwen3_omni.video_layout import frame_times, with_audio_tokens
from omnistage.pipeline.talker_prefix import talker_keys

AUDIO_TOKEN = 151676  # Qwen3-ASR's <|audio_pad|>
IDS = [151644] * 10 + [AUDIO_TOKEN] * 60 + [198] * 10
ROWS = np.arange(10, 70)
VIDEO_TOKEN, VIDEO_ROWS = 151656, 21_989  # Qwen3-Omni's <|video_pad|>; a 30 s video's rows with its sound
VIDEO_GRID, VIDEO_AUDIO = (
    (30, 36, 80),
    389,
)  # its temporal patches (2 s at 2 fps each), 720 rows each; its track


def video_positions() -> tuple[TalkerPrompt, Qwen3OmniConfig, MediaLayout]:
    """A 30 s video's Talker prompt (its rope ids), the released config, and the video's layout."""
    cfg = Qwen3OmniConfig.from_dir(released_skeleton("qwen3-omni"))
    thinker = cfg.thinker
    step = round(2 * thinker.position_id_per_seconds)
    times = frame_times(VIDEO_GRID, thinker.vision.spatial_merge_size, step)
    merged = with_audio_tokens(times, VIDEO_AUDIO, thinker.video_token_id, thinker.audio_token_id)
    user = [
        151644,
        872,
        198,
        thinker.vision_start_token_id,
        *merged,
        thinker.vision_end_token_id,
        151645,
        198,
    ]
    rope_ids = torch.tensor([*user, *[0] * 9])  # the 9 assistant rows are text to the positions
    layout = MediaLayout([], [VIDEO_AUDIO], [VideoLayout(VIDEO_GRID, step, True)])
    return TalkerPrompt(torch.empty(0), rope_ids), cfg, layout


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
    speech = SpeechTokens(151644, 872, 77091, (151675, 151655, VIDEO_TOKEN), 0, 0, 0, 0, 0, 0, 0, 0, {})
    video_ids = [151644, 872, 198, *[VIDEO_TOKEN] * VIDEO_ROWS, *[198] * 16, 151645, 198, 151644, 77091, 198]
    hidden = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (VIDEO_ROWS, 4096), dtype=np.uint8))
    hidden = hidden.view(torch.bfloat16)
    user = len(video_ids) - 3  # the Talker prompt's user rows, then its 9 assistant rows
    positions = PromptPositions(torch.arange(user + 9).expand(3, -1).contiguous(), 0)
    prompt, cfg, layout = video_positions()
    timed = {
        "prefix keys (PageKeys.of_prompt)": (lambda: PageKeys.of_prompt(IDS, 16, media=media), args.calls),
        "placeholder rows (EncoderStage._place)": (
            lambda: stage._place(IDS, audio, VisionRows()),
            args.calls,
        ),
        "a 30 s video's Talker keys (talker_keys)": (
            lambda: talker_keys(video_ids, speech, hidden, positions, 16),
            max(1, args.calls // 100),
        ),
        "a 30 s video's Talker positions (talker_positions)": (
            lambda: talker_positions(prompt, cfg, layout),
            max(1, args.calls // 100),
        ),
    }
    print(f"omnistage from {omnistage.__file__}")
    for name, (fn, calls) in timed.items():
        fn()
        print(f"{name}: {best_us(fn, calls, args.repeats):.1f} µs a call")


if __name__ == "__main__":
    main()
