"""Synthetic videos encoded with PyAV, for the benchmarks and the tests (no video files in the repository):
drifting colour fields with, where asked, a tone for a sound track."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import cast

import av
import numpy as np

CONTAINERS = {"mp4": ("mp4", "libx264", "aac"), "webm": ("webm", "libvpx", "libopus"),
              "mov": ("mov", "mpeg4", "aac"), "mkv": ("matroska", "mpeg4", "libopus")}  # fmt: skip


def frames(count: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 [count, height, width, 3]: a smooth gradient drifting frame by frame, plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        for c in range(3):
            out[i, :, :, c] = (128 + 100 * np.sin((x + 3 * i) / (9 + c) + y / (13 + 2 * c))).astype(np.uint8)
    noise = rng.integers(0, 8, out.shape, dtype=np.uint8)
    return out + noise


def sliding(count: int, width: int, height: int, seed: int = 0) -> Iterator[np.ndarray]:
    """`count` uint8 [height, width, 3] frames one at a time, each a window sliding over one wide field of
    `frames`' gradient: moving content at the cost of a slice, for minutes of 720p without minutes of numpy."""
    step = 8
    field = frames(1, width + step * count, height, seed)[0]
    for i in range(count):
        yield field[:, step * i : step * i + width]


def encode(
    pictures: Iterable[np.ndarray],
    fps: int = 10,
    kind: str = "mp4",
    tone_hz: float | None = 440.0,
    sample_rate: int = 48000,
    tone_seconds: float | None = None,
) -> bytes:
    """`pictures` (an array of frames or any iterable of them, all of one size) as a video file of `kind` at
    `fps`; with `tone_hz`, a sound track of that tone, `tone_seconds` long (default: as long as the video)."""
    fmt, vcodec, acodec = CONTAINERS[kind]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        video = cast(av.VideoStream, container.add_stream(vcodec, rate=fps))
        video.pix_fmt = "yuv420p"
        audio = None
        if tone_hz is not None:
            audio = cast(av.AudioStream, container.add_stream(acodec, rate=sample_rate))
            audio.layout = "stereo"
        count = 0
        for picture in pictures:
            if not count:
                video.width, video.height = picture.shape[1], picture.shape[0]
            count += 1
            for packet in video.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None and tone_hz is not None:
            n = round((count / fps if tone_seconds is None else tone_seconds) * sample_rate)
            t = np.arange(n) / sample_rate
            wave = (0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
            step = 960
            for start in range(0, n, step):
                chunk = np.stack([wave[start : start + step]] * 2)
                frame = av.AudioFrame.from_ndarray(
                    np.ascontiguousarray(chunk), format="fltp", layout="stereo"
                )
                frame.sample_rate = sample_rate
                for packet in audio.encode(frame):
                    container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    return buffer.getvalue()
