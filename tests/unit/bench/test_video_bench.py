"""The v2s harness: its command line, the sample rates it tries against the context, the videos it writes, and
a short in-process run on the tiny checkpoint beside transformers (random weights: a few frames of noise)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from omnistage.bench import video_speech, video_targets
from omnistage.bench.speech_targets import SpeechTiming
from omnistage.bench.video_speech import parse_resolution
from omnistage.bench.video_targets import (
    VideoInput,
    fitting_fps,
    sample_rates,
    write_videos,
)
from omnistage.cli import build_parser
from omnistage.media import MediaPolicy
from omnistage.models.qwen3_omni.video_decoding import decode_video
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig

TEXT_TOKENS, FRAMES = 3, 5


def test_command_line():
    args = build_parser().parse_args(["bench", "v2s", "--load-format", "dummy"])
    assert args.func is video_speech.main and args.workload == "v2s"
    assert (args.video_seconds, args.resolution, args.concurrency, args.requests) == ("10,30,120", (1280, 720),
                                                                                      "1,8", 1)  # fmt: skip
    assert (args.text_tokens, args.frames, args.natural, args.video_fps, args.source_fps) == (
        40,
        125,
        False,
        None,
        2,
    )
    assert (args.baseline, args.baseline_requests, args.baseline_max_seconds, args.fail_on_build) == (None, 1, None,
                                                                                                      False)  # fmt: skip
    assert (args.moe_kernel, args.long_prefill_kernel) == (None, None)  # the engine's own
    args = build_parser().parse_args(["bench", "v2s", "--resolution", "64x48", "--baseline", "transformers",
                                      "--baseline-max-seconds", "30", "--video-fps", "1", "--fail-on-build",
                                      "--moe-kernel", "grouped_mm", "--long-prefill-kernel", "triton"])  # fmt: skip
    assert (
        args.resolution,
        args.baseline_max_seconds,
        args.video_fps,
        args.fail_on_build,
        args.moe_kernel,
        args.long_prefill_kernel,
    ) == (
        (64, 48),
        30,
        1,
        True,
        "grouped_mm",
        "triton",
    )
    for wrong in (["--resolution", "720p"], ["--resolution", "1x720"], ["--url", "http://h:1"], ["--tts"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "v2s", *wrong])
    assert parse_resolution("1280X720") == (1280, 720)


def test_sample_rates_halve_the_processors_within_whole_second_patches():
    assert sample_rates(2.0, 2, None) == [2.0, 1.0, 0.5]
    assert sample_rates(1.0, 2, None) == [1.0, 0.5, 0.25]
    assert sample_rates(2.0, 2, 0.5) == [0.5]


def test_each_request_sends_a_video_of_its_own(tmp_path):
    (video,) = write_videos([1.0], (64, 48), tmp_path, source_fps=4, files=3)
    files = [video.as_request(n).path for n in (-1, 0, 1)]  # the warm-up's and two timed requests'
    assert len(set(files)) == 3 and video.as_request(0) == video and all(f.parent == tmp_path for f in files)
    contents = {f.read_bytes() for f in files}
    assert len(contents) == 3  # each its own frames and tone
    decoded = [decode_video(f.read_bytes(), VideoProcessorConfig(), with_audio=True) for f in files]
    assert len({d.frames.tobytes() for d in decoded}) == 3 and len({d.audio.tobytes() for d in decoded}) == 3


def test_videos_are_written_once_per_length_and_sampled_to_fit_the_context(tmp_path):
    videos = write_videos([1.0, 3.0], (64, 48), tmp_path, source_fps=4)
    assert [v.name for v in videos] == ["video-1s", "video-3s"] and all(
        v.path.parent == tmp_path for v in videos
    )
    assert videos[0].messages()[0]["content"][0] == {
        "type": "video_url",
        "video_url": {"url": str(videos[0].path)},
    }
    assert videos[1].options().use_audio_in_video and videos[1].options().fps is None
    seen = []

    def process_chat(decoded, add_generation_prompt, context, use_audio_in_video, tools=None):
        video = decoded[0]["content"][0]["video"]
        seen.append((len(video.frames), video.fps, use_audio_in_video, video.audio is not None))
        return SimpleNamespace(token_ids=[0] * (100 * len(video.frames)))

    processor = SimpleNamespace(process_chat=process_chat)
    policy = MediaPolicy(media_dir=tmp_path)
    # 3 s at 2 fps samples 6 frames (600 tokens), at 1 fps 4 (the processor's least): 400 + 50 fit 450
    item, tokens = fitting_fps(videos[1], processor, policy, 450, 50, [2.0, 1.0, 0.5])
    assert (item.fps, tokens, item.path) == (1.0, 400, videos[1].path)
    assert seen == [(6, 2.0, True, True), (4, 1.0, True, True)]
    item, tokens = fitting_fps(
        videos[1], processor, policy, 100, 50, [2.0, 1.0]
    )  # none fits: the last rate's
    assert (item.fps, tokens) == (1.0, 400)


def test_summary_adds_the_first_text_tokens():
    timings = [
        SpeechTiming(0.2, 1.0, 2.0, 25, 4, {"decode": 0.01, "first_text_token": 0.1}),
        SpeechTiming(0.4, 2.0, 2.0, 25, 4, {"decode": 0.03, "first_text_token": 0.3}),
    ]
    s = video_speech.summarize(timings, [2.0], 2)
    assert s["ttft_median_ms"] == 200.0 and s["ttft_p90_ms"] == pytest.approx(280.0)
    assert s["first_packet_median_ms"] == 300.0 and s["stages_median_ms"]["decode"] == 20.0


def test_in_process_run_beside_transformers(tiny_checkpoint, tmp_path, capsys):
    args = build_parser().parse_args(
        ["bench", "v2s", "--model", str(tiny_checkpoint), "--device", "cpu", "--video-seconds", "1,2",
         "--resolution", "64x48", "--concurrency", "1,2", "--text-tokens", str(TEXT_TOKENS), "--frames",
         str(FRAMES), "--baseline", "transformers", "--baseline-max-seconds", "1", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    args.func(args)
    result = json.loads((tmp_path / "v2s.json").read_text())
    assert result["pools_after"]["full"] and result["engine_start_s"] > 0 and result["resolution"] == "64x48"
    one, two = result["lengths"]
    assert (one["seconds"], one["fps"], two["seconds"]) == (1.0, 2.0, 2.0)
    assert 0 < one["prompt_tokens"] < two["prompt_tokens"] and "error" not in one and "error" not in two
    for entry in (one, two):
        assert [p["concurrency"] for p in entry["ours"]] == [1, 2]
        assert [p["requests"] for p in entry["ours"]] == [1, 2]
        for p in entry["ours"]:
            assert p["frames"] == [FRAMES] and p["text_tokens"] == [TEXT_TOKENS]
            assert 0.3 < p["audio_s"] / p["requests"] <= FRAMES / 12.5 and p["audio_s_per_s"] > 0
            assert 0 < p["ttft_median_ms"] < p["first_packet_median_ms"] <= p["latency_median_ms"]
            stages = p["stages_median_ms"]
            assert (
                0 < stages["decode"] < stages["preprocess"] < stages["encoded"] <= stages["first_text_token"]
            )
        # a video of its own for each of the warm-up and the three timed requests: nothing from the caches (the
        # encoder cache's misses count each video and its sound track)
        served = entry["caches_served"]
        assert served["encoder_cache_misses"] == 2 * 4 and served["encoder_cache_hits"] == 0
        assert served["prefix_cache_queries"] >= 4 * entry["prompt_tokens"]
        assert served["prefix_cache_hits"] == served["talker_prefix_cache_hits"] == 0
    hf = one["transformers"]
    assert hf["requests"] == 1 and hf["frames"] == [FRAMES] and hf["text_tokens"] == [TEXT_TOKENS]
    assert 0 < hf["ttft_median_ms"] < hf["first_packet_median_ms"] == hf["latency_median_ms"]
    assert two["transformers"] == {"skipped": "longer than --baseline-max-seconds 1"}
    printed = capsys.readouterr().out
    assert "| 1 s | 2 | " in printed and "transformers (not streamed) | 1 | 1 |" in printed
    assert "| 2 s | 2 | " in printed and "skipped: longer than --baseline-max-seconds 1" in printed
    assert "ours, 2 s, c=2, from arrival (median ms): decode " in printed


def test_a_length_that_fails_is_reported_and_the_run_exits_non_zero(tiny_checkpoint, tmp_path, monkeypatch):
    """A request that fails stops its length alone: its error is in the JSON, the next length still runs."""

    def runner(*args):
        async def run(item: VideoInput, number: int) -> SpeechTiming:
            if item.seconds == 1:
                raise RuntimeError(f"{item.name}: the engine failed it")
            return SpeechTiming(0.1, 0.2, 1.0, 2, 2, {"first_text_token": 0.05})

        return run

    monkeypatch.setattr(video_targets, "inprocess_runner", runner)  # run_v2s imports it when it runs
    args = build_parser().parse_args(
        ["bench", "v2s", "--model", str(tiny_checkpoint), "--device", "cpu", "--video-seconds", "1,2",
         "--resolution", "64x48", "--concurrency", "1", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    with pytest.raises(SystemExit, match="video-1s failed"):
        args.func(args)
    one, two = json.loads((tmp_path / "v2s.json").read_text())["lengths"]
    assert one["error"] == "RuntimeError: video-1s: the engine failed it" and "ours" not in one
    assert "error" not in two and two["ours"][0]["ttft_median_ms"] == 50.0


def test_a_follow_up_turn_finds_what_its_first_turn_left(tiny_checkpoint, tmp_path, capsys):
    """`--follow-up`: each request is timed as a conversation's second turn about its video, run just after its
    first: the video comes from the decoded videos kept, its rows and its track's from the encoder cache, the
    first turn's pages from both prefix caches."""
    args = build_parser().parse_args(
        ["bench", "v2s", "--model", str(tiny_checkpoint), "--device", "cpu", "--video-seconds", "1",
         "--resolution", "64x48", "--concurrency", "1", "--text-tokens", str(TEXT_TOKENS), "--frames",
         str(FRAMES), "--follow-up", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    args.func(args)
    result = json.loads((tmp_path / "v2s.json").read_text())
    (entry,) = result["lengths"]
    assert result["follow_up"] and result["pools_after"]["full"] and "error" not in entry
    served = entry["caches_served"]
    # the warm-up's and the timed request's first turns encode a video and its track each, their second turns
    # find both
    assert served["encoder_cache_misses"] == served["encoder_cache_hits"] == 2 * 2
    assert served["prefix_cache_hits"] >= 2 * (entry["prompt_tokens"] // 16) * 16 > 0
    assert served["talker_prefix_cache_hits"] > 0
    # the timed request's first turn, a video new to the server, is reported beside it
    first, second = entry["first_turns"], entry["ours"][0]
    assert first["requests"] == second["requests"] == 1
    assert first["stages_median_ms"]["encoded"] > second["stages_median_ms"]["encoded"]
    printed = capsys.readouterr().out
    assert "| ours, second turn | 1 | 1 |" in printed and "| ours, first turn | 1 | 1 |" in printed
