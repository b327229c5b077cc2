"""Videos decoding at once (`media.load_video`): at most two (one on a single core), the others in the order they
came, and a video kept decoded returned without waiting for a turn."""

from __future__ import annotations

import threading
import time

import numpy as np

from omnistage import media
from omnistage.models.cpu_threads import cores
from omnistage.models.qwen3_omni.video_processing import DecodedVideo

STAGGER_S = 0.005


class SlowDecoder:
    """Stands in for `decode_video`: records which file started when and how many ran at once, and holds each
    call until `release` is set (or for `seconds`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = threading.Event()
        self.started: list[bytes] = []
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, data: bytes, *_args: object) -> DecodedVideo:
        with self._lock:
            self.started.append(data)
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(self.seconds)
        with self._lock:
            self.running -= 1
        return DecodedVideo(np.zeros((2, 4, 4, 3), np.uint8), 2.0)


def load_at_once(files: list[bytes], policy: media.MediaPolicy) -> list[threading.Thread]:
    """Each file loaded on a thread of its own, the threads started `STAGGER_S` apart."""
    threads = [
        threading.Thread(target=media.load_video, args=(f, policy, media.VideoOptions())) for f in files
    ]
    for thread in threads:
        thread.start()
        time.sleep(STAGGER_S)
    return threads


AT_ONCE = min(2, cores())


def test_two_videos_decode_at_once_the_rest_in_turn(monkeypatch):
    assert media.VIDEO_DECODES_AT_ONCE == AT_ONCE
    files = [b"video %d" % i for i in range(AT_ONCE + 3)]
    # every file has come before the first decode ends, so the waiting ones are woken in their order
    decoder = SlowDecoder(seconds=len(files) * STAGGER_S + 0.1)
    monkeypatch.setattr(media, "decode_video", decoder)
    for thread in load_at_once(files, media.MediaPolicy(decoded_videos=media.DecodedVideos(0))):
        thread.join(timeout=30)
    assert decoder.most == AT_ONCE
    assert decoder.started == files


def test_a_kept_video_does_not_wait_for_a_turn(monkeypatch):
    decoder = SlowDecoder(seconds=30)
    monkeypatch.setattr(media, "decode_video", decoder)
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(64 << 20))
    decoder.release.set()
    kept = media.load_video(b"kept", policy, media.VideoOptions())
    decoder.release.clear()

    busy = load_at_once([b"busy %d" % i for i in range(AT_ONCE)], policy)
    deadline = time.monotonic() + 10
    while decoder.running < AT_ONCE:
        assert time.monotonic() < deadline, "the decodes did not all start"
        time.sleep(0.01)
    start = time.perf_counter()
    assert media.load_video(b"kept", policy, media.VideoOptions()) is kept
    assert time.perf_counter() - start < 1.0
    # a file not kept waits while every turn is taken
    waiting = threading.Thread(target=media.load_video, args=(b"new", policy, media.VideoOptions()))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and b"new" not in decoder.started
    decoder.release.set()
    for thread in [*busy, waiting]:
        thread.join(timeout=30)
    assert decoder.started[-1] == b"new"
