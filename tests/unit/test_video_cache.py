"""Videos kept decoded (`media.DecodedVideos`): a video sent again, asked of the same way, is the one decoded
before, its patches and key made once; asked of another way it is decoded again; the kept bytes are bounded,
least recently used out; `--video-cache-mib` sets the bound."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest

from omnistage import media
from omnistage.bench.videos import encode, frames
from omnistage.cli.parser import build_parser
from omnistage.cli.serve import server_options
from omnistage.config.loading import engine_config
from omnistage.errors import ConfigError
from omnistage.models.qwen3_omni import video_processing
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig


def part(data: bytes) -> dict:
    return {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()},
    }


@pytest.fixture
def decodings(monkeypatch) -> list[bytes]:
    """The files decoded (not taken from the cache), in order."""
    seen: list[bytes] = []
    decode = media.decode_video

    def counting(data, *args):
        seen.append(data)
        return decode(data, *args)

    monkeypatch.setattr(media, "decode_video", counting)
    return seen


def decoded(data: bytes, policy: media.MediaPolicy, **options):
    return media.decode_part(part(data), policy, "messages[0].content[0]", media.VideoOptions(**options))[
        "video"
    ]


def test_a_video_sent_again_is_the_one_decoded_before(decodings):
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(64 << 20))
    a, b = encode(frames(8, 64, 48), fps=2), encode(frames(8, 64, 48, seed=1), fps=2)
    first = decoded(a, policy, use_audio_in_video=True)
    assert decoded(a, policy, use_audio_in_video=True) is first and decodings == [a]
    assert policy.decoded_videos.hits == 1
    # another file, or the same asked of another way, is decoded
    other = decoded(b, policy, use_audio_in_video=True)
    without_sound = decoded(a, policy)
    fewer = decoded(a, policy, use_audio_in_video=True, max_frames=2)
    assert decodings == [a, b, a, a] and without_sound.audio is None and len(fewer.frames) == 2
    kept = (first, other, without_sound, fewer)
    assert policy.decoded_videos.bytes == sum(
        2 * v.frames.nbytes + (0 if v.audio is None else v.audio.nbytes) for v in kept
    )


def test_its_patches_and_key_are_made_once(monkeypatch):
    video = video_processing.DecodedVideo(frames(4, 64, 48), 2.0)
    made: list[int] = []
    preprocess = video_processing.preprocess_video

    def counting(frames_, cfg):
        made.append(len(frames_))
        return preprocess(frames_, cfg)

    monkeypatch.setattr(video_processing, "preprocess_video", counting)
    cfg = VideoProcessorConfig()
    patches, grid, key = video.patches(cfg)
    again = video.patches(cfg)
    assert made == [4] and again[0] is patches and again[1:] == (grid, key)
    want_patches, want_grid = preprocess(video.frames, cfg)
    assert grid == want_grid and np.array_equal(patches.numpy(), want_patches.numpy())
    other = video.patches(VideoProcessorConfig(min_pixels=2 * 128 * 32 * 32))  # resized larger
    assert made == [4, 4] and other[2] != key


def test_the_least_recently_used_leave_past_the_budget(decodings):
    files = [encode(frames(8, 64, 48, seed=i), fps=2, tone_hz=None) for i in range(3)]
    probe = decoded(files[0], media.MediaPolicy(decoded_videos=media.DecodedVideos(0)))
    size = 2 * probe.frames.nbytes  # no sound track asked
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(2 * size))
    for data in (files[0], files[1], files[0], files[2]):  # the first used again, so the second leaves
        decoded(data, policy)
    assert policy.decoded_videos.bytes == 2 * size and policy.decoded_videos.hits == 1
    decoded(files[0], policy)
    decoded(files[1], policy)
    assert decodings == [files[0]] + files + [files[1]]


def test_none_kept_with_a_budget_of_zero(decodings):
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(0))
    data = encode(frames(8, 64, 48), fps=2, tone_hz=None)
    decoded(data, policy)
    decoded(data, policy)
    assert decodings == [data, data] and policy.decoded_videos.bytes == 0


def test_the_budget_is_a_server_flag():
    parser = build_parser()
    options = server_options(parser.parse_args(["serve", "--video-cache-mib", "8"]), engine_config())
    assert options.media.decoded_videos.max_bytes == 8 << 20
    default = server_options(parser.parse_args(["serve"]), engine_config())
    assert default.media.decoded_videos.max_bytes == media.VIDEO_CACHE_MIB << 20
    with pytest.raises(ConfigError, match="--video-cache-mib"):
        server_options(parser.parse_args(["serve", "--video-cache-mib", "-1"]), engine_config())


def test_a_copy_sent_to_another_process_keeps_the_budget_not_the_videos():
    # a Ray Serve replica's server options are pickled, its media policy with them
    policy = media.MediaPolicy(decoded_videos=media.DecodedVideos(64 << 20))
    decoded(encode(frames(8, 64, 48), fps=2, tone_hz=None), policy)
    copy = pickle.loads(pickle.dumps(policy))
    assert copy.decoded_videos.max_bytes == 64 << 20 and copy.decoded_videos.bytes == 0
    assert policy.decoded_videos.bytes > 0
