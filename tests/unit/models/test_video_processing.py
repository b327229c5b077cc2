"""Video decoding (PyAV) and preprocessing: sampling rules, patches, and every bound a clear InvalidMedia."""

from __future__ import annotations

import contextlib
import io
import threading

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omnistage.bench.videos import CONTAINERS, encode, frames
from omnistage.errors import InvalidMedia
from omnistage.models.multimodal import PixelNorm
from omnistage.models.qwen3_omni import video_decoding, video_processing
from omnistage.models.qwen3_omni.image_processing import ImageProcessorConfig, preprocess_image
from omnistage.models.qwen3_omni.video_decoding import RESIZE_AHEAD, VideoLimits, decode_video
from omnistage.models.qwen3_omni.video_processing import (
    VideoProcessorConfig,
    preprocess_video,
    resized,
    sample_indices,
    temporal_step,
    video_grid,
    video_tokens,
)

CFG = VideoProcessorConfig()


def test_sampling_rules():
    # 10 s at 30 fps sampled at 2 fps: 20 frames, evenly spaced from the first
    assert sample_indices(300, 30.0, CFG, 2.0, 768) == list(range(0, 300, 15))
    # short: at least min_frames (4), rounded down to whole temporal patches, never more than the stream's
    assert sample_indices(25, 10.0, CFG, 2.0, 768) == [0, 6, 12, 18]
    assert sample_indices(3, 10.0, CFG, 2.0, 768) == [0, 1]
    # long: max_frames caps it, still a multiple of the temporal patch
    assert len(sample_indices(3000, 30.0, CFG, 2.0, 7)) == 6
    with pytest.raises(InvalidMedia, match="at least 2"):
        sample_indices(1, 10.0, CFG, 2.0, 768)


def test_grid_tokens_and_position_step():
    assert video_grid(4, 48, 64, CFG) == (2, 20, 28)  # upscaled to the 128-token minimum a frame
    assert video_grid(5, 48, 64, CFG)[0] == 3  # an odd frame count repeats the last frame
    assert video_tokens((2, 20, 28), 2) == 280
    assert temporal_step(CFG, 2.0, 13) == 13 and temporal_step(CFG, 1.0, 13) == 26
    assert temporal_step(CFG, 0.5, 13) == 52
    for fps in (3.0, 2.6, 4.0, 1.5):  # a temporal patch of 2/3, 0.77, 0.5, 1.33 s
        with pytest.raises(
            InvalidMedia, match=r"must last whole seconds, so fps is 2 / k \(2, 1, 0.667, 0.5, ...\)"
        ):
            temporal_step(CFG, fps, 13)


def test_a_still_video_at_the_target_size_is_the_image_patches():
    """No resampling on either side: two equal frames give the image processor's patches (which repeat an
    image over the temporal patch), whose layout is proven against transformers."""
    picture = frames(1, 64, 64)[0]
    cfg = VideoProcessorConfig(min_pixels=64 * 64, max_pixels=64 * 64)
    patches, grid = preprocess_video(np.stack([picture, picture]), cfg)
    image_cfg = ImageProcessorConfig(min_pixels=64 * 64, max_pixels=64 * 64)
    expected, image_grid = preprocess_image(Image.fromarray(picture), image_cfg)
    assert grid == image_grid == (1, 4, 4)
    assert patches.dtype == expected.dtype == torch.uint8 and torch.equal(patches, expected)


def test_frames_resized_first_give_the_same_patches():
    """The decoder resizes each frame as it comes; the patches are those of the frames resized together."""
    video = frames(4, 64, 48)
    at_once, grid = preprocess_video(video, CFG)
    one_by_one = np.stack([resized(frame[None], CFG)[0] for frame in video])
    first, first_grid = preprocess_video(one_by_one, CFG)
    assert grid == first_grid and torch.equal(at_once, first)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_patch_is_its_pixels_normalised_bit_for_bit(threads, monkeypatch):
    """Every patch, found by its place in the grid (merge block by merge block, temporal patch by temporal
    patch), holds its T frames' P x P pixels of each channel as bytes, and `PixelNorm` makes them (x - mean /
    r) / (std / r) in float32, exactly; with a channel mean and std of their own and an odd frame count (the
    last frame repeated), the temporal patches reordered on one thread or split among several."""
    monkeypatch.setattr(video_processing, "shared_threads", lambda: contextlib.nullcontext(threads))
    cfg = VideoProcessorConfig(image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
    video = frames(5, 160, 96, seed=3)
    raw, (grid_t, grid_h, grid_w) = preprocess_video(video, cfg)
    assert raw.dtype == torch.uint8 and raw.is_contiguous()
    patches = PixelNorm.of(cfg)(raw)
    assert patches.dtype == torch.float32
    pixels = torch.from_numpy(resized(np.concatenate((video, video[-1:])), cfg)).permute(3, 0, 1, 2)
    mean = torch.tensor(cfg.image_mean) / cfg.rescale_factor
    std = torch.tensor(cfg.image_std) / cfg.rescale_factor
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    row = 0
    for frame in range(0, grid_t * t, t):
        for block_y in range(0, grid_h, m):
            for block_x in range(0, grid_w, m):
                for y in range(block_y, block_y + m):
                    for x in range(block_x, block_x + m):
                        cut = pixels[:, frame : frame + t, y * p : (y + 1) * p, x * p : (x + 1) * p]
                        expected = (cut.float() - mean.view(-1, 1, 1, 1)) / std.view(-1, 1, 1, 1)
                        assert torch.equal(patches[row], expected.flatten()), (frame, y, x)
                        row += 1
    assert row == len(patches)


def test_preprocess_rejects_what_is_not_frames():
    with pytest.raises(InvalidMedia, match="uint8"):
        preprocess_video(np.zeros((2, 8, 8, 3), np.float32), CFG)
    with pytest.raises(InvalidMedia, match="uint8"):
        preprocess_video(np.zeros((8, 8, 3), np.uint8), CFG)


@pytest.mark.parametrize("kind", CONTAINERS)
def test_every_container_decodes_with_its_sound(kind):
    pictures = frames(20, 64, 48)
    video = decode_video(encode(pictures, fps=10, kind=kind), CFG, with_audio=True)
    # the encoded frames at indices 0, 5, 10, 15, resized as decoded (to 320x448); lossy: close, not equal
    expected = resized(pictures[[0, 5, 10, 15]], CFG)
    assert video.frames.shape == expected.shape == (4, 320, 448, 3) and video.fps == 2.0
    error = np.abs(video.frames.astype(int) - expected.astype(int)).mean()
    assert error < 12
    assert video.audio is not None and abs(len(video.audio) / 16000 - 2.0) < 0.1
    assert decode_video(encode(pictures, fps=10, kind=kind), CFG).audio is None


@pytest.mark.parametrize(("cores", "workers"), [(1, 0), (2, 1), (16, 4)])
def test_frames_resized_beside_the_decoder_are_those_decoded_one_by_one(cores, workers, monkeypatch):
    # 12 s at 2 fps, every frame kept: more frames than may wait for their resizes; each equal to the same
    # decoder's frame resized on its own, in order, on as many resize workers as the decoder's share of the
    # cores gives (on one core: resized as decoded, on the decoder's thread)
    monkeypatch.setattr(video_decoding, "cores", lambda: cores)
    monkeypatch.setattr(video_decoding, "shared_decoder_threads", lambda: contextlib.nullcontext(cores))
    converted_on: set[str] = set()
    convert = video_decoding._rgb_resized

    def recorded(frame, cfg):
        converted_on.add(threading.current_thread().name)
        return convert(frame, cfg)

    monkeypatch.setattr(video_decoding, "_rgb_resized", recorded)
    data = encode(frames(24, 320, 240), fps=2, tone_hz=None)
    with av.open(io.BytesIO(data)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    video = decode_video(data, CFG)
    expected = np.stack([resized(frame[None], CFG)[0] for frame in decoded])
    assert len(video.frames) > 2 * RESIZE_AHEAD and np.array_equal(video.frames, expected)
    workers_used = {name for name in converted_on if name.startswith("video-resize")}
    assert video_decoding.resizers(cores) == max(workers, 1)
    assert 0 < len(workers_used) <= workers if workers else converted_on == {threading.current_thread().name}


def test_a_decoder_on_its_share_of_the_cores_gives_the_same_frames(monkeypatch):
    # several videos at once each decode on cores / videos threads: one thread gives what every core gives
    data = encode(frames(24, 320, 240), fps=8, tone_hz=None)
    whole = decode_video(data, CFG).frames
    taken: list[int] = []
    share = video_decoding.shared_decoder_threads

    def one_thread():
        with share() as threads:
            taken.append(threads)
        return contextlib.nullcontext(1)

    monkeypatch.setattr(video_decoding, "shared_decoder_threads", one_thread)
    assert np.array_equal(decode_video(data, CFG).frames, whole) and len(taken) == 1


def test_rate_and_frame_overrides():
    data = encode(frames(40, 32, 32), fps=10, tone_hz=None)  # 4 s
    assert len(decode_video(data, CFG, fps=1.0).frames) == 4
    assert len(decode_video(data, CFG).frames) == 8
    assert len(decode_video(data, CFG, max_frames=6).frames) == 6
    with pytest.raises(InvalidMedia, match="fps 8 is not one the positions admit"):
        decode_video(data, CFG, fps=8.0)
    with pytest.raises(InvalidMedia, match=r"max frames 999 is outside \[1, 256\]"):
        decode_video(data, CFG, max_frames=999)


def test_defects_and_bounds_are_named():
    data = encode(frames(30, 32, 32), fps=10, tone_hz=None)
    with pytest.raises(InvalidMedia, match="empty"):
        decode_video(b"", CFG)
    with pytest.raises(InvalidMedia, match="corrupt or unsupported container"):
        decode_video(b"\x00\x01garbage" * 100, CFG)
    with pytest.raises(InvalidMedia, match="corrupt or unsupported container"):
        decode_video(data[: len(data) // 3], CFG)
    wav = io.BytesIO()
    sf.write(wav, np.zeros(16000, np.float32), 16000, format="WAV")
    with pytest.raises(InvalidMedia, match="no video stream"):
        decode_video(wav.getvalue(), CFG)
    with pytest.raises(InvalidMedia, match=r"too long: 3\.0 s, the limit is 2 s"):
        decode_video(data, CFG, VideoLimits(max_seconds=2))
    with pytest.raises(InvalidMedia, match="too many frames: 30, the limit is 20"):
        decode_video(data, CFG, VideoLimits(max_stream_frames=20))
    with pytest.raises(InvalidMedia, match="more than the 1,000 accepted"):
        decode_video(data, CFG, VideoLimits(max_frame_pixels=1000))
    with pytest.raises(InvalidMedia, match="no audio track, and use_audio_in_video asks for one"):
        decode_video(data, CFG, with_audio=True)


def test_make_tiny_writes_the_video_preprocessor_config(tiny_checkpoint):
    assert (tiny_checkpoint / "video_preprocessor_config.json").exists()
    assert VideoProcessorConfig.from_dir(tiny_checkpoint) == CFG


def test_a_sound_track_as_long_as_the_limit_is_not_refused_for_its_codec_padding():
    """AAC's priming and last-frame padding decode a track a few hundredths of a second longer than it was
    written: a video exactly as long as the limit still decodes, its sound cut to the limit."""
    data = encode(frames(20, 32, 32), fps=10, kind="mp4")
    decoded = decode_video(data, CFG, VideoLimits(max_seconds=2), with_audio=True)
    assert decoded.audio is not None and len(decoded.audio) == 2 * 16000


def test_a_sound_track_far_past_the_limit_is_refused_without_decoding_it_whole():
    data = encode(frames(20, 32, 32), fps=10, kind="mp4", tone_seconds=30.0)
    with pytest.raises(InvalidMedia, match=r"audio track is too long: more than 2\.5 s, the limit is 2 s"):
        decode_video(data, CFG, VideoLimits(max_seconds=2, max_stream_frames=10_000), with_audio=True)
