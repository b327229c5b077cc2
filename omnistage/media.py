"""OpenAI content parts with media to the decoded parts the processor takes.

`input_audio` (base64 with its format), `audio_url`, `image_url` and `video_url` become `{"type": "audio",
"audio": float32 16 kHz mono}`, `{"type": "image", "image": PIL.Image}` and `{"type": "video", "video":
DecodedVideo}` (its frames sampled, its sound track decoded where `use_audio_in_video` asks); an offline
`{"type": "video", "video": path}` is read and decoded the same way. A URL is fetched only where the server's
policy allows it: `data:` always, `http(s)` with `--allow-remote-media`, local files under `--media-dir`.
Everything here blocks (fetching, decoding, resampling), so the app runs it in a worker thread. Every
problem is an InvalidMedia naming the part and, where a flag would allow it, the flag.

The server prepares many requests at once (pipeline/preparing.py), but decodes at most `DECODING_AT_ONCE`
media parts at once, the number of threads that once prepared every request: decoded frames and pictures are
the memory a flood of large media requests would take. Of those, at most `VIDEO_DECODES_AT_ONCE` are videos:
two. Each video's decoding already spreads over the cores (its decoder's threads and its frames' resizers,
`cpu_threads`), so past two at once each more video only splits them finer and delays every one's end; waiting
its turn, a later video lets the earlier ones reach the GPU sooner. Two was the best median of eight at once on a
2-core and on a 16-core host (RESULTS.md, "Videos decoding at once" and "Eight videos decoding at once on a
16-core GPU host").
"""

from __future__ import annotations

import binascii
import os
import threading
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
import xxhash

from omnistage.errors import InvalidMedia
from omnistage.models.cpu_threads import cores
from omnistage.models.qwen3_omni.audio_features import MAX_SECONDS, SAMPLE_RATE, decode_audio, resample
from omnistage.models.qwen3_omni.image_processing import decode_image
from omnistage.models.qwen3_omni.video_decoding import VideoLimits, decode_video
from omnistage.models.qwen3_omni.video_processing import DecodedVideo, VideoProcessorConfig

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
MEDIA_TYPES = ("input_audio", "audio_url", "image_url", "video_url")
DECODING_AT_ONCE = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default pool of worker threads
_decoding = threading.BoundedSemaphore(DECODING_AT_ONCE)
VIDEO_DECODES_AT_ONCE = min(2, cores())
_video_decodes = threading.BoundedSemaphore(VIDEO_DECODES_AT_ONCE)  # waiters wake in the order they came
VIDEO_CACHE_MIB = 512  # videos kept decoded by default: two 30 s 720p videos with their patches


class DecodedVideos:
    """Videos decoded before, by a digest of their file's bytes and of how they were decoded, least recently used
    out past `max_bytes` (0: none kept). A chat about a video sends the video with every turn: kept, a turn
    spares its decoding (~0.6 s for 30 s of 720p on a GPU server's host) and, its patches made once
    (`DecodedVideo.patches`), their making; the encoder cache then spares the vision tower. A video is counted
    as twice its frames' bytes (its frames and the patches made of them) and its sound track's. Requests decode
    on worker threads at once, hence the lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self._videos: OrderedDict[bytes, tuple[DecodedVideo, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type[DecodedVideos], tuple[int]]:
        """A copy sent to another process (a Ray Serve replica's options) keeps its budget, not its videos."""
        return DecodedVideos, (self.max_bytes,)

    @staticmethod
    def key(data: bytes, *how: object) -> bytes:
        """A 128-bit XXH3 digest of a file's bytes and of everything `how` its decoding went (the processor's
        config, the limits, the request's options)."""
        digest = xxhash.xxh3_128(repr(how).encode())
        digest.update(data)
        return digest.digest()

    def get(self, key: bytes) -> DecodedVideo | None:
        with self._lock:
            kept = self._videos.get(key)
            if kept is None:
                return None
            self._videos.move_to_end(key)
            self.hits += 1
            return kept[0]

    def put(self, key: bytes, video: DecodedVideo) -> None:
        size = 2 * video.frames.nbytes + (0 if video.audio is None else video.audio.nbytes)
        with self._lock:
            if size > self.max_bytes or key in self._videos:
                return
            self._videos[key] = video, size
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._videos.popitem(last=False)
                self.bytes -= evicted


@dataclass(frozen=True)
class MediaPolicy:
    """Where attachments may come from and how much of them a request may carry."""

    allow_remote: bool = False  # http(s) URLs: off by default, a server should not fetch for strangers
    media_dir: Path | None = None  # local files: only under this directory
    max_bytes: int = 32 * 1024 * 1024  # one fetched or read file, as the default request body limit
    fetch_timeout_s: float = 10.0
    max_audio_seconds: float = MAX_SECONDS
    # Counted before anything is decoded, so a request of a thousand images costs nothing: the processor's
    # 8 audios + 8 images; it applies the per-kind limits after decoding.
    max_attachments: int = 16
    video: VideoLimits = field(default_factory=VideoLimits)
    video_processing: VideoProcessorConfig = field(default_factory=VideoProcessorConfig)
    # videos kept decoded, for the requests that send them again (`--video-cache-mib`)
    decoded_videos: DecodedVideos = field(
        default_factory=lambda: DecodedVideos(VIDEO_CACHE_MIB << 20), compare=False
    )


@dataclass(frozen=True)
class VideoOptions:
    """What one request asks of its videos' decoding, within the policy's limits."""

    use_audio_in_video: bool = False  # decode each video's sound track, to be interleaved with its frames
    fps: float | None = None  # frames sampled a second (default: the processor's)
    max_frames: int | None = None  # the most frames sampled from one video (default: the limits')


def decode_messages(
    messages: list[dict[str, Any]], policy: MediaPolicy, video: VideoOptions = VideoOptions()
) -> list[dict[str, Any]]:
    """Messages in OpenAI's shape with every media part fetched and decoded. Raises InvalidMedia."""
    count = sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") in MEDIA_TYPES or _video_path(p) is not None
    )
    if count > policy.max_attachments:
        raise InvalidMedia(
            f"too many attachments: {count}, the limit is {policy.max_attachments} per request"
        )
    decoded = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = [
                decode_part(part, policy, f"messages[{i}].content[{j}]", video)
                for j, part in enumerate(content)
            ]
        decoded.append({**message, "content": content})
    return decoded


def decode_part(
    part: dict[str, Any], policy: MediaPolicy, where: str, video: VideoOptions = VideoOptions()
) -> dict[str, Any]:
    """One content part: media fetched and decoded (one of the decodings at once), anything else unchanged."""
    kind = part.get("type")
    path = _video_path(part)
    if kind not in MEDIA_TYPES and path is None:
        return part
    try:
        if kind == "input_audio":
            given = part.get("input_audio") or {}
            fmt = given.get("format")
            if fmt not in AUDIO_FORMATS:
                raise InvalidMedia(
                    f"input_audio.format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}"
                )
            data = _base64(given.get("data") or "")
        else:
            data = fetch(_url(part, str(kind)) if path is None else path, policy)
        with _decoding:
            if kind in ("input_audio", "audio_url"):
                return {"type": "audio", "audio": _load_audio(data, policy)}
            if kind == "image_url":
                return {"type": "image", "image": decode_image(data)}
            return {"type": "video", "video": load_video(data, policy, video)}
    except InvalidMedia as exc:
        raise InvalidMedia(f"{where}: {exc}") from None


def load_audio(data: bytes, policy: MediaPolicy) -> np.ndarray:
    """Audio file bytes to float32 mono at the model's 16 kHz (one of the decodings at once)."""
    with _decoding:
        return _load_audio(data, policy)


def _load_audio(data: bytes, policy: MediaPolicy) -> np.ndarray:
    samples, rate = decode_audio(data, max_seconds=policy.max_audio_seconds)
    return resample(samples, rate, SAMPLE_RATE)


def load_video(data: bytes, policy: MediaPolicy, options: VideoOptions) -> DecodedVideo:
    """Video file bytes to its sampled frames and, where asked, its sound track at 16 kHz (one of the videos
    decoding at once); a video the policy keeps decoded (`DecodedVideos`) as it was decoded before, at once."""
    kept = policy.decoded_videos
    key = kept.key(data, policy.video_processing, policy.video, options) if kept.max_bytes else b""
    if key and (video := kept.get(key)) is not None:
        return video
    with _video_decodes:
        video = decode_video(
            data,
            policy.video_processing,
            policy.video,
            options.fps,
            options.max_frames,
            options.use_audio_in_video,
        )
    if key:
        kept.put(key, video)
    return video


def _video_path(part: object) -> str | None:
    """The file an offline `{"type": "video", "video": path}` part names."""
    if isinstance(part, dict) and part.get("type") == "video" and isinstance(part.get("video"), str | Path):
        return str(part["video"])
    return None


def audio_seconds(audio: np.ndarray) -> float:
    """The length of audio `load_audio` decoded, in seconds."""
    return len(audio) / SAMPLE_RATE


def fetch(url: str, policy: MediaPolicy) -> bytes:
    """The bytes behind a data:, http(s), file: URL or a plain path, as the policy allows."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url)
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise InvalidMedia(
                f"remote media URLs are disabled on this server ({_short(url)}); send the data inline as a "
                "data: URL or base64, or start the server with --allow-remote-media"
            )
        return _download(url, policy)
    if scheme in ("file", ""):
        return _read_local(url, policy)
    raise InvalidMedia(f"URL scheme {scheme!r} is not supported; use data:, http(s) or a local path")


def _url(part: dict[str, Any], key: str) -> str:
    given = part.get(key)
    url = given.get("url") if isinstance(given, dict) else given
    if not isinstance(url, str) or not url:
        raise InvalidMedia(f"{key}.url is missing")
    return url


def _base64(data: str) -> bytes:
    try:
        return pybase64.b64decode(data, validate=True)  # one strict pass: what clients send
    except (binascii.Error, ValueError):
        pass
    try:
        # Line breaks and spaces are common in pasted base64; anything else outside the alphabet is an error.
        return pybase64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidMedia(f"the data is not valid base64 ({exc})") from None


def _data_url(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise InvalidMedia("the data: URL has no ',' before its data")
    if header.lower().endswith(";base64"):
        return _base64(payload)
    return urllib.parse.unquote_to_bytes(payload)


def _download(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=policy.fetch_timeout_s, follow_redirects=True) as response:
            if response.status_code != 200:
                raise InvalidMedia(f"fetching {_short(url)} answered HTTP {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise InvalidMedia(
                        f"{_short(url)} is larger than the limit of {policy.max_bytes:,} bytes"
                    )
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise InvalidMedia(f"fetching {_short(url)} failed: {type(exc).__name__}: {exc}") from None


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.media_dir is None:
        raise InvalidMedia(
            f"local media paths are disabled on this server ({_short(url)}); start the server with "
            "--media-dir DIR to serve files under DIR"
        )
    if url.lower().startswith("file:"):
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidMedia(f"file URL {_short(url)} names a host; only local files are served")
        url = urllib.parse.unquote(parsed.path)
    if "\x00" in url:  # no file has one, and the OS would refuse it with a ValueError
        raise InvalidMedia("the path holds a NUL character")
    root = policy.media_dir.resolve()
    try:
        path = (root / url).resolve()  # an absolute path stays itself; symlinks and .. are resolved away
    except (OSError, RuntimeError):  # pathlib reports a symlink loop as a RuntimeError
        raise InvalidMedia(f"{_short(url)} cannot be resolved (a symlink loop?)") from None
    if not path.is_relative_to(root):
        raise InvalidMedia(
            f"{_short(url)} is outside the media directory; only files under --media-dir are served"
        )
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise InvalidMedia(f"{_short(url)} is larger than the limit of {policy.max_bytes:,} bytes")
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise InvalidMedia(f"{_short(url)} does not exist in the media directory") from None
    except OSError as exc:
        raise InvalidMedia(f"{_short(url)} cannot be read: {exc.strerror}") from None


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[: limit - 3] + "..."
