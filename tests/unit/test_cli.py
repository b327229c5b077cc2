"""The `omnistage` command line: fast help that shows every default and choice, --version, and a busy port."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from importlib.metadata import version

import pytest

from omnistage.cli import build_parser, main
from omnistage.config import EngineConfig, engine_config
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def test_help_of_every_command_loads_neither_torch_nor_transformers():
    # A fresh interpreter: this test process has long imported torch.
    script = (
        "import sys, contextlib, io\n"
        "from omnistage.cli import main\n"
        "for argv in ([], ['serve'], ['plan'], ['memory-report'], ['make-tiny'], ['bench'], ['bench', 'a2t']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([*argv, '--help'])\n"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"omnistage {version('omnistage')}"


def test_serve_help_shows_every_default_and_the_schemas_choices():
    serve = subcommand("serve")
    for action in serve._actions:
        if action.option_strings and action.nargs != 0:  # flags that take a value
            assert action.help and "default" in action.help, action.option_strings
    options = {a.dest: a for a in serve._actions}
    for key in ("device", "dtype", "load_format", "moe_kernel", "long_prefill_kernel"):
        annotation = EngineConfig.model_fields[key].annotation
        assert options[key].choices == typing.get_args(annotation)
    assert "(default: 16)" in options["page_size"].help
    assert "(default: 2048)" in options["max_num_batched_tokens"].help
    text = serve.format_help()
    assert "{auto,cpu,cuda}" in text and "{auto,grouped_mm,triton}" in text


def test_help_lists_every_endpoint_of_the_app(tiny_checkpoint):
    engine = AsyncPipeline.from_config(
        engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=16)
    )
    try:
        paths = set(build_app(engine, "m").openapi()["paths"])
    finally:
        engine.shutdown()
    assert "/v1/audio/transcriptions" in paths and "/v1/models/{model}" in paths
    serve_help = subcommand("serve").format_help()
    for path in paths:
        assert path in serve_help, path
    top_help = build_parser().format_help()
    for word in ("chat", "completions", "transcriptions", "models"):
        assert word in top_help.split("serve", 1)[1], word


def test_a_choice_outside_the_schema_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--device", "tpu"])
    assert exited.value.code == 2
    assert "argument --device: invalid choice: 'tpu'" in capsys.readouterr().err


def test_a_busy_port_fails_before_the_model_loads(tiny_checkpoint, monkeypatch, capsys):
    loaded = []

    def refuse_to_load(*args, **kwargs):
        loaded.append(True)
        raise AssertionError("the model started loading")

    monkeypatch.setattr(AsyncPipeline, "from_config", refuse_to_load)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import socket, time\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
         "print(s.getsockname()[1], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(holder.stdout.readline())
        code = main(["serve", "--port", str(port), "--model", str(tiny_checkpoint), "--device", "cpu"])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and not loaded
    err = capsys.readouterr().err
    assert f"omnistage: error: port {port} is in use" in err


def test_plan_loads_prints_and_exits(tiny_checkpoint, tmp_path, capsys):
    assert main(["plan", "--model", str(tiny_checkpoint), "--device", "cpu", "--num-kv-pages", "32"]) == 0
    printed = capsys.readouterr().out
    assert "no GPU plan: the engine runs on the CPU" in printed and "KV pool 32 pages" in printed
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  page_sise: 4\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "engine.page_sise: unknown key" in capsys.readouterr().err


def test_memory_report_on_the_cpu_says_so_and_lists_what_the_stages_hold(tiny_checkpoint, capsys):
    argv = ["memory-report", "--model", str(tiny_checkpoint), "--device", "cpu", "--num-kv-pages", "32"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "no GPU plan: the engine runs on the CPU" in printed
    assert "no CUDA: the stages run on the CPU, where torch's allocator keeps no snapshot" in printed
    rows = [line.split() for line in printed.splitlines() if line.startswith("  cpu ")]
    owners = {(row[1], row[2]) for row in rows}
    assert {
        ("weights", "thinker.model"),
        ("KV", "thinker.runner"),
        ("weights", "speech_stages.talker"),
    } <= owners, printed
    assert "KV pool 32 pages" in printed


def test_overlap_stages_is_off_unless_asked_for(tmp_path):
    from omnistage.cli.engine_flags import engine_config_of

    for command in ("serve", "plan"):
        assert engine_config_of(build_parser().parse_args([command])).overlap_stages is False
        args = build_parser().parse_args([command, "--overlap-stages"])
        assert engine_config_of(args).overlap_stages is True
    config = tmp_path / "c.yaml"
    config.write_text("engine:\n  overlap_stages: true\n")
    assert (
        engine_config_of(build_parser().parse_args(["serve", "--config", str(config)])).overlap_stages is True
    )


def test_each_engine_flag_sets_the_schema_key_it_names_and_says_which():
    from omnistage.cli.engine_flags import engine_config_of
    from omnistage.config.flags import FLAGS, SWITCHES

    options = {a.option_strings[0]: a for a in subcommand("serve")._actions if a.option_strings}
    for flag, path in FLAGS.items():
        action = options[flag]
        given = (
            action.choices[-1] if action.choices else {int: "4", float: "0.5", str: "/models/m"}[action.type]
        )
        value: object = engine_config_of(build_parser().parse_args(["serve", flag, given]))
        for key in path.split("."):
            value = getattr(value, key)
        assert value == action.type(given), flag
        assert path.startswith("stages.") == action.help.startswith(f"{path}: "), action.help
    for flag, (key, on) in SWITCHES.items():
        assert getattr(engine_config_of(build_parser().parse_args(["serve", flag])), key) is on, flag


def test_voice_alias_is_repeatable_and_replaces_the_files_aliases(tmp_path, capsys):
    from omnistage.cli.engine_flags import engine_config_of

    args = ["serve", "--voice-alias", "alloy=chelsie", "--voice-alias", "narrator = aiden"]
    assert engine_config_of(build_parser().parse_args(args)).voice_aliases == {
        "alloy": "chelsie",
        "narrator": "aiden",
    }
    assert engine_config_of(build_parser().parse_args(["serve"])).voice_aliases == {}
    config = tmp_path / "c.yaml"
    config.write_text("engine:\n  voice_aliases:\n    ash: chelsie\n")
    from_file = build_parser().parse_args(["serve", "--config", str(config)])
    assert engine_config_of(from_file).voice_aliases == {"ash": "chelsie"}
    flagged = build_parser().parse_args(["serve", "--config", str(config), "--voice-alias", "echo=aiden"])
    assert engine_config_of(flagged).voice_aliases == {"echo": "aiden"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--voice-alias", "alloy"])
    assert "'alloy': give NAME=VALUE" in capsys.readouterr().err
