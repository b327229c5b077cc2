"""Videos decoding at once on the host, as the server decodes them (`media.load_video`): N distinct videos
arriving together, with at most L decoding at once for each L given, the others waiting their turn. Prints when
the first, the median and the last video was decoded (ms from the arrival, medians of `--runs` rounds after a
warm-up): the GPU starts on a video once it is decoded, so the first and the median matter as much as the last.

The videos are the v2s benchmark's (`videos.sliding` frames in an mp4 with an AAC tone), each its own; decoded
with their sound, as `use_audio_in_video` asks. L = N is every video at once (the server before
`media.VIDEO_DECODES_AT_ONCE`); the server's own L is two (one on a single core).

    python benchmarks/video_at_once.py --videos 8 --seconds 10 --source-fps 2 --at-once 8,4,2,1
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--resolution", default="1280x720")
    parser.add_argument("--source-fps", type=int, default=2)
    parser.add_argument("--at-once", default="8,4,2,1", help="videos decoding at once, comma separated")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from omnistage import media
    from omnistage.bench.video_targets import TRACK_MARGIN_S
    from omnistage.bench.videos import encode, sliding

    width, height = map(int, args.resolution.split("x"))
    count = round(args.seconds * args.source_fps)
    files = [
        encode(
            sliding(count, width, height, seed=i),
            fps=args.source_fps,
            tone_seconds=count / args.source_fps - TRACK_MARGIN_S,
        )
        for i in range(args.videos)
    ]
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(0))
    options = media.VideoOptions(use_audio_in_video=True)
    media.load_video(files[0], policy, options)  # warm-up

    def round_ms(limit: int) -> list[float]:
        media._video_decodes = threading.BoundedSemaphore(limit)
        done = [0.0] * len(files)
        start = time.perf_counter()

        def load(i: int) -> None:
            media.load_video(files[i], policy, options)
            done[i] = (time.perf_counter() - start) * 1e3

        threads = [threading.Thread(target=load, args=(i,)) for i in range(len(files))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sorted(done)

    print(
        f"{args.videos} videos of {args.seconds:g} s {width}x{height} at {args.source_fps} fps with their sound, "
        f"{len(os.sched_getaffinity(0))} cores (torch {torch.get_num_threads()} threads; the server's L "
        f"{media.VIDEO_DECODES_AT_ONCE}), {args.runs} rounds\n"
    )
    print("| L at once | first ms | median ms | last ms |\n| --- | --- | --- | --- |")
    for limit in (int(n) for n in args.at_once.split(",")):
        round_ms(limit)
        rounds = [round_ms(limit) for _ in range(args.runs)]
        first, median, last = (
            statistics.median(pick(r) for r in rounds) for pick in (min, statistics.median, max)
        )
        print(f"| {limit} | {first:,.0f} | {median:,.0f} | {last:,.0f} |")


if __name__ == "__main__":
    main()
