"""benchmarks/admission_host.py: a CPU run of the admission's and the hand-off's host-work timer on this tree."""

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "admission_host.py"


def test_it_times_the_keys_and_the_placeholder_rows_of_this_tree(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--calls", "3", "--repeats", "2"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"omnistage from {Path(__file__).parents[1] / 'omnistage' / '__init__.py'}"
    timed = dict(line.rsplit(": ", 1) for line in lines[1:])
    assert list(timed) == [
        "prefix keys (PageKeys.of_prompt)",
        "placeholder rows (EncoderStage._place)",
        "a 30 s video's Talker keys (talker_keys)",
        "a 30 s video's Talker positions (talker_positions)",
    ]
    assert all(value.endswith(" µs a call") and float(value.split()[0]) > 0 for value in timed.values())
