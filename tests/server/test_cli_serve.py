"""`omnistage serve` start-up checks that need no running server: the YAML schema and the example file."""

from __future__ import annotations

from pathlib import Path

from omnistage.cli import build_parser, main
from omnistage.config import load_config

EXAMPLE = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def test_example_config_loads_and_flags_override_it():
    config = load_config(EXAMPLE, num_kv_pages=32, max_model_len=None)
    assert (config.device, config.page_size, config.stage("thinker").kv.pages, config.max_model_len) == (
        "cpu",
        16,
        32,
        4096,
    )


def test_unknown_yaml_key_stops_the_server_with_its_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  page_sise: 16\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert f"{bad}: engine.page_sise: unknown key" in capsys.readouterr().err


def test_bad_flag_value_names_the_key(capsys):
    assert main(["serve", "--page-size", "0"]) == 2
    assert "page_size: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_serve_defaults_bind_localhost_and_leave_engine_keys_unset():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.max_queue) == ("127.0.0.1", 8000, None, None)
    assert args.model is None and args.device is None and args.enforce_eager is None


def test_media_flags(tmp_path, capsys):
    args = build_parser().parse_args(["serve"])
    assert args.allow_remote_media is False and args.media_dir is None
    args = build_parser().parse_args(["serve", "--allow-remote-media", "--media-dir", str(tmp_path)])
    assert args.allow_remote_media is True and args.media_dir == str(tmp_path)
    assert main(["serve", "--media-dir", str(tmp_path / "missing")]) == 2
    assert f"--media-dir {tmp_path / 'missing'}: not a directory" in capsys.readouterr().err


def test_a_model_directory_that_does_not_exist_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint"
    assert main(["serve", "--model", str(missing), "--device", "cpu"]) == 2
    assert f"{missing}: the checkpoint directory does not exist" in capsys.readouterr().err


def test_a_pool_too_small_for_one_request_of_the_context_stops_the_server(capsys):
    args = ["serve", "--device", "cpu", "--num-kv-pages", "64", "--max-model-len", "2048"]
    assert main(args) == 2
    assert (
        "engine.stages.thinker.num_kv_pages: 64 pages of 16 tokens hold 1,024 tokens, less than one request of 2,048"
        in (capsys.readouterr().err)
    )


def test_connection_flags(capsys):
    args = build_parser().parse_args(["serve"])
    assert (args.max_connections, args.header_timeout) == (1024, 10.0)
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout 0.0: must be above 0 seconds" in capsys.readouterr().err
    assert main(["serve", "--max-connections", "0"]) == 2
    assert "--max-connections 0: must be at least 1" in capsys.readouterr().err


def test_video_flags_set_the_media_policys_bounds(capsys):
    from omnistage.cli.serve import server_options
    from omnistage.config import EngineConfig
    from omnistage.models.qwen3_omni.video_decoding import VideoLimits

    config = EngineConfig(model=None)
    assert server_options(build_parser().parse_args(["serve"]), config).media.video == VideoLimits()
    flags = ["serve", "--max-video-seconds", "600", "--max-video-frames", "300"]
    video = server_options(build_parser().parse_args(flags), config).media.video
    assert (video.max_seconds, video.max_stream_frames, video.max_frames) == (600, 36_000, 300)
    assert video.max_frame_pixels == VideoLimits().max_frame_pixels
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for default in (VideoLimits().max_seconds, VideoLimits().max_frames, VideoLimits().max_frame_pixels):
        assert f"(default: {default:.12g}" in " ".join(help_text.split())
    assert main(["serve", "--max-video-frame-pixels", "0"]) == 2
    assert "--max-video-frame-pixels 0: must be at least 1" in capsys.readouterr().err
