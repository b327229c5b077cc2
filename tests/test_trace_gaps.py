"""benchmarks/trace_gaps.py: the gaps between a stage's steps in a step trace, split by what the loop did."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "trace_gaps.py"
trace_gaps = runpy.run_path(str(SCRIPT))  # the script's functions, by name


def call(stage, start_ms, ms, rows=1, kind="decode"):
    """A step_trace record: `at` is the call's end in seconds."""
    return {"stage": stage, "kind": kind, "rows": rows, "chunks": 0, "at": (start_ms + ms) / 1e3, "ms": ms}


CALLS = [
    call("Thinker", 0, 3, rows=128),
    call("Thinker", 5, 3, rows=128),  # 2 ms after the first: no gap past the bound
    # 8 -> 40 ms: an admission of 20 ms holding 15 ms of encoding, then 12 ms of nothing traced
    call("engine loop", 10, 20, rows=30, kind="admitted"),
    call("encoders", 12, 15, rows=30, kind="media"),
    call("Thinker", 40, 9, rows=2048, kind="mixed, several chunks"),
    # an admission running past the gap's end counts only inside it
    call("engine loop", 60, 30, kind="admitted"),
    call("Thinker", 80, 3, rows=128),
    call("Talker", 20, 5),  # another stage's steps are not the Thinker's
]


def test_each_gap_is_split_into_admission_encoding_and_the_rest():
    found = trace_gaps["gaps"](CALLS, "Thinker", min_ms=10)
    assert [
        (g["after_ms"], g["gap_ms"], g["admitting_ms"], g["encoding_ms"], g["rest_ms"]) for g in found
    ] == [
        (5.0, 32.0, 20.0, 15.0, 12.0),
        (46.0, 31.0, 20.0, 0.0, 11.0),
    ]
    assert (found[0]["kind_before"], found[0]["rows_before"], found[0]["kind_after"]) == (
        "decode",
        128,
        "mixed, several chunks",
    )
    assert trace_gaps["gaps"](CALLS, "Thinker", min_ms=31.5)[0]["gap_ms"] == 32.0


def test_the_script_prints_a_row_per_gap_and_their_sums(tmp_path, monkeypatch, capsys):
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps({"calls": CALLS + [{"stage": "prefill graphs", "kind": "replayed", "ms": 0.0}]})
    )
    monkeypatch.setattr(sys, "argv", ["trace_gaps.py", str(path)])
    trace_gaps["main"]()
    out = capsys.readouterr().out
    assert "| 5.0 | 32.0 | 20.0 | 15.0 | 12.0 | decode (128 rows) | mixed, several chunks |" in out
    assert "2 gaps: {'gap_ms': 63.0, 'admitting_ms': 40.0, 'encoding_ms': 15.0, 'rest_ms': 23.0}" in out
