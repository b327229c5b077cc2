"""Video files (mp4, webm, mov, mkv: whatever FFmpeg in PyAV's wheels reads) to the processor's sampled frames.

The container is read from memory: once by its packets alone (no decoding) to count the frames and check
the bounds; then the video stream is decoded up to the last sampled frame, each sampled frame converted to
RGB and resized to the processor's size on worker threads beside the decoder (a few decoded frames held at
most), and, with `with_audio`, the first audio stream on a thread of its own, mixed to mono and resampled to
16 kHz. A request's decoder, its resizes (torch) and its sound track work at once on a GPU server's host, none
waiting for another, and several videos decoding at once share the cores
(`cpu_threads.shared_decoder_threads`). Everything here blocks (decoding releases the GIL); the server runs it
in a worker thread. Every defect or bound is an InvalidMedia saying which.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import av
import numpy as np

from omnistage.errors import InvalidMedia
from omnistage.models.cpu_threads import cores, shared_decoder_threads
from omnistage.models.qwen3_omni.audio_features import SAMPLE_RATE, resample
from omnistage.models.qwen3_omni.video_processing import (
    DecodedVideo,
    VideoProcessorConfig,
    check_fps,
    resized,
    sample_indices,
)


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost to decode; the defaults admit two minutes of 4K at 60 fps."""

    max_seconds: float = 120.0
    max_frames: int = 256  # sampled frames: what the vision tower sees (two minutes at the released 2 fps)
    max_stream_frames: int = 120 * 60  # frames in the stream, each decoded to reach the sampled ones
    max_frame_pixels: int = 3840 * 2160


def decode_video(
    data: bytes,
    cfg: VideoProcessorConfig,
    limits: VideoLimits = VideoLimits(),
    fps: float | None = None,
    max_frames: int | None = None,
    with_audio: bool = False,
) -> DecodedVideo:
    """Decode and sample a video file: `fps` frames a second (default: the processor's), at most `max_frames`
    (default: the limits', and no more); with `with_audio` its sound track too."""
    fps = cfg.fps if fps is None else fps
    max_frames = limits.max_frames if max_frames is None else max_frames
    check_fps(cfg, fps)
    if not 0 < max_frames <= limits.max_frames:
        raise InvalidMedia(f"video max frames {max_frames} is outside [1, {limits.max_frames}]")
    if not data:
        raise InvalidMedia("video is empty (0 bytes)")
    try:
        total, stream_fps, has_audio = _survey(data, limits)
        if with_audio and not has_audio:
            raise InvalidMedia("video has no audio track, and use_audio_in_video asks for one")
        wanted = sample_indices(total, stream_fps, cfg, fps, min(max_frames, cfg.max_frames))
        if not with_audio:
            return DecodedVideo(_frames(data, wanted, cfg), fps, None)
        with ThreadPoolExecutor(1, thread_name_prefix="video-sound") as pool:
            sound = pool.submit(_audio, data, limits.max_seconds)
            frames = _frames(data, wanted, cfg)
            audio = sound.result()
    except (av.FFmpegError, ValueError, OverflowError) as exc:
        raise InvalidMedia(
            f"video could not be decoded (a corrupt or unsupported container): {exc}"
        ) from None
    return DecodedVideo(frames, fps, audio)


def _survey(data: bytes, limits: VideoLimits) -> tuple[int, float, bool]:
    """(frames in the first video stream, its frame rate, whether there is an audio stream), from the
    packets alone; the bounds checked before anything is decoded."""
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise InvalidMedia("video has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_frame_pixels:
            raise InvalidMedia(
                f"video frames are {width}x{height} pixels, more than the {limits.max_frame_pixels:,} accepted"
            )
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise InvalidMedia("video declares no frame rate")
        total = stream.frames
        if total <= 0:  # webm and mkv declare no count: the packets tell it
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if total <= 0:
            raise InvalidMedia("video has no frames")
        seconds = total / float(rate)
        if seconds > limits.max_seconds:
            raise InvalidMedia(f"video is too long: {seconds:.1f} s, the limit is {limits.max_seconds:g} s")
        if total > limits.max_stream_frames:
            raise InvalidMedia(
                f"video has too many frames: {total:,}, the limit is {limits.max_stream_frames:,} per video"
            )
        return total, float(rate), bool(container.streams.audio)


RESIZE_AHEAD = 4  # decoded full-size frames that may wait for each resize worker: the decoder's lead, bounded
MAX_RESIZERS = 4  # resize workers a video takes at most, with half its share of the cores


def resizers(threads: int) -> int:
    """The resize workers of a video whose decoder may take `threads` threads: a frame's resize (torch's uint8
    antialiased bicubic) gains little from more threads of its own, so the cores go to several frames at
    once, as many as keep up with the decoder (RESULTS.md, "A chat's video kept decoded and encoded; pinning
    a video's rows; a start that failed": a fresh video's host work)."""
    return max(1, min(MAX_RESIZERS, threads // 2))


def _frames(data: bytes, wanted: list[int], cfg: VideoProcessorConfig) -> np.ndarray:
    """The frames at the indices `wanted` (ascending), RGB at the processor's size, decoding no further than
    the last. Where torch has more than one core, each kept frame is resized on a worker thread (`resizers`;
    where there are several, converted to RGB there too) while the next ones decode, at most `RESIZE_AHEAD`
    decoded frames waiting for each worker (on one core the hand-offs cost more than they overlap:
    RESULTS.md, "Video decoding beside its resizes")."""
    keep, last = set(wanted), wanted[-1]
    resizes: dict[int, Future[np.ndarray]] = {}  # in decoding order
    with shared_decoder_threads() as threads:
        workers = resizers(threads) if cores() > 1 else 1
        ahead = RESIZE_AHEAD * workers
        convert_here = workers == 1  # one worker: the decoder converts, the two threads' shares balanced
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="video-resize") as pool,
            av.open(io.BytesIO(data), mode="r") as container,
        ):
            resize = pool.submit if cores() > 1 else _resized_now
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = threads  # not all the cores for each of several videos
            for i, frame in enumerate(container.decode(stream)):
                if i in keep:
                    if len(resizes) >= ahead:  # waits for the frame `ahead` back, so at most `ahead` wait
                        list(resizes.values())[-ahead].result()
                    picture = frame.to_ndarray(format="rgb24") if convert_here else frame
                    resizes[i] = resize(_rgb_resized, picture, cfg)
                if i >= last:
                    break
            frames = {i: future.result() for i, future in resizes.items()}
    if len(frames) < len(keep):  # the stream held fewer decodable frames than its packets promised
        raise InvalidMedia(f"video decoded to {len(frames)} of the {len(keep)} frames sampled from it")
    sizes = {f.shape for f in frames.values()}
    if len(sizes) > 1:
        raise InvalidMedia(f"video frames change size mid-stream ({sorted(sizes)})")
    return np.stack([frames[i] for i in wanted])


def _rgb_resized(frame: av.VideoFrame | np.ndarray, cfg: VideoProcessorConfig) -> np.ndarray:
    """One decoded frame (or its RGB pixels) as uint8 RGB [H, W, 3] at the processor's size (FFmpeg's
    conversion releases the interpreter's lock, so several workers convert at once)."""
    rgb = frame if isinstance(frame, np.ndarray) else frame.to_ndarray(format="rgb24")
    return resized(rgb[None], cfg)[0]


def _resized_now(function: Callable[..., np.ndarray], *args: Any) -> Future[np.ndarray]:
    """`function(*args)` run here, as a done Future: the resize where no other core would take it."""
    done: Future[np.ndarray] = Future()
    done.set_result(function(*args))
    return done


# Codecs decode a track a little longer than it was written (AAC's priming and its last frame's padding: a few
# hundredths of a second): a track up to this much past the limit is cut to it rather than refused.
CODEC_PADDING_S = 0.5


def _audio(data: bytes, max_seconds: float) -> np.ndarray:
    """The first audio stream as float32 mono at 16 kHz, its channels averaged as decode_audio does; decoding
    stops once the track is past the limit by more than codec padding, and a track within it is cut to the
    limit."""
    chunks: list[np.ndarray] = []
    samples = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        if not rate:
            raise InvalidMedia("video's audio track declares no sample rate")
        bound = round((max_seconds + CODEC_PADDING_S) * rate)
        planar = av.AudioResampler(format="fltp")  # any sample format as float planes [channels, n]
        for frame in container.decode(stream):
            new = [f.to_ndarray() for f in planar.resample(frame)]
            chunks += new
            samples += sum(c.shape[1] for c in new)
            if samples > bound:
                raise InvalidMedia(
                    f"video's audio track is too long: more than {max_seconds + CODEC_PADDING_S:g} s, "
                    f"the limit is {max_seconds:g} s"
                )
        chunks += [f.to_ndarray() for f in planar.resample(None)]
    if not chunks:
        raise InvalidMedia("video's audio track holds no samples")
    # the channels averaged once per run of frames with as many channels, not once per frame (a thousand
    # calls for 30 s of AAC): the same sums, a quarter less time for the whole track
    runs = [np.concatenate(list(run), axis=1).mean(axis=0) for _, run in groupby(chunks, key=len)]
    mono = np.concatenate(runs).astype(np.float32, copy=False)[: round(max_seconds * rate)]
    if not np.isfinite(mono).all():
        raise InvalidMedia("video's audio track holds NaN or infinite samples")
    return resample(mono, rate, SAMPLE_RATE)
