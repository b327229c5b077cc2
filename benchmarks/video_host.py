"""The host's share of a video request, stage by stage, on the CPU: decoding (the packets surveyed, the sampled
frames decoded and resized, the sound track decoded and resampled) and processing (the patches, the sound's
log-mel, both as the processor's `featurise` makes them), as the server runs them for a `video_url` with
`use_audio_in_video`; where the patches are bytes, also their normalisation, which the server runs on the
encoders' device.

The video is the benchmark's: `seconds` of `videos.sliding` frames at `--source-fps` in an mp4 (H.264, AAC
tone), written once in memory. The process is pinned to the first `--threads` cores, so FFmpeg's decoder
threads and torch's team both see that many. Prints the median and the least of `--runs` runs per stage (ms),
after one warm-up run. To compare two trees, run it from outside both with PYTHONPATH naming the one to time:

    PYTHONPATH=$PWD python benchmarks/video_host.py --threads 1
    PYTHONPATH=$PWD python benchmarks/video_host.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--resolution", default="1280x720")
    parser.add_argument("--source-fps", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    torch.set_num_threads(args.threads)
    # imported after the pinning: cpu_threads counts the cores torch sees when it is first imported
    from omnistage.bench.video_targets import TRACK_MARGIN_S
    from omnistage.bench.videos import encode, sliding
    from omnistage.models.qwen3_omni import video_decoding as vd
    from omnistage.models.qwen3_omni.audio_features import log_mel
    from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
    from omnistage.models.qwen3_omni.image_processing import ImageProcessorConfig
    from omnistage.models.qwen3_omni.prompt_media import MediaFormats, MediaParts, featurise
    from omnistage.models.qwen3_omni.tiny import released_config
    from omnistage.models.qwen3_omni.video_processing import (
        VideoProcessorConfig,
        preprocess_video,
        sample_indices,
    )

    width, height = map(int, args.resolution.split("x"))
    count = round(args.seconds * args.source_fps)
    data = encode(
        sliding(count, width, height),
        fps=args.source_fps,
        tone_seconds=count / args.source_fps - TRACK_MARGIN_S,
    )
    cfg, limits = VideoProcessorConfig(), vd.VideoLimits()
    total, rate, _ = vd._survey(data, limits)
    wanted = sample_indices(total, rate, cfg, cfg.fps, cfg.max_frames)
    decoded = vd.decode_video(data, cfg, limits, with_audio=True)
    assert decoded.audio is not None
    thinker = Qwen3OmniConfig.from_dict(released_config()).thinker
    formats = MediaFormats(thinker, ImageProcessorConfig(), cfg)
    parts = MediaParts([("video", "messages[0].content[0]", decoded)])
    stages: dict[str, Callable[[], object]] = {
        "survey": lambda: vd._survey(data, limits),
        "frames (decode + resize)": lambda: vd._frames(data, wanted, cfg),
        "sound (decode + resample)": lambda: vd._audio(data, limits.max_seconds),
        "decode_video (all of the above)": lambda: vd.decode_video(data, cfg, limits, with_audio=True),
        "patches (preprocess_video)": lambda: preprocess_video(decoded.frames, cfg),
        "log-mel (CPU)": lambda: log_mel(decoded.audio),
        "featurise (all of the processing)": lambda: featurise(parts, formats, True),
    }
    from omnistage.models import multimodal

    if hasattr(
        multimodal, "PixelNorm"
    ):  # trees whose patches are bytes: the floats are made where the tower runs
        patches = preprocess_video(decoded.frames, cfg)[0]
        norm = multimodal.PixelNorm.of(cfg)
        stages["normalise (PixelNorm, here on the CPU)"] = lambda: norm(patches)
    print(
        f"{args.seconds:g} s {width}x{height} at {args.source_fps} fps ({len(data) / 1e6:.1f} MB), "
        f"{len(wanted)} frames sampled to {decoded.frames.shape[1]}x{decoded.frames.shape[2]}, "
        f"{args.threads} thread(s), {args.runs} runs\n"
    )
    print("| stage | median ms | least ms |\n| --- | --- | --- |")
    for name, stage in stages.items():
        stage()
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            stage()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"| {name} | {statistics.median(times):,.1f} | {min(times):,.1f} |")


if __name__ == "__main__":
    main()
