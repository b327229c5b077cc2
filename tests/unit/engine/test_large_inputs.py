"""benchmarks/large_inputs.py as a CPU smoke run on the embedded tiny checkpoint."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "large_inputs.py"


def test_large_inputs_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("large_inputs", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "large.json"
    results = bench.main(["--tiny", "--device", "cpu", "--images", "64x64", "200x96", "--clips", "1.5",
                          "--output-tokens", "3", "--out", str(out)])  # fmt: skip
    assert results["all_ok"] and json.loads(out.read_text()) == results
    assert [r["input"] for r in results["requests"]] == ["image 64x64", "image 200x96", "audio 1.5 s"]
    assert all(r["output_tokens"] == 3 and r["max_memory_allocated_gib"] is None for r in results["requests"])
    printed = capsys.readouterr().out
    assert "image 200x96     ok" in printed and "audio 1.5 s      ok" in printed
