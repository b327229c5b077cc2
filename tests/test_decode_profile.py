"""benchmarks/decode_profile.py: a CPU smoke run over a tiny Qwen3-ASR checkpoint."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_profile.py"


def test_decode_profile_smoke(tmp_path, monkeypatch, capsys):
    from omnistage.models.qwen3_asr.tiny import make_tiny

    spec = importlib.util.spec_from_file_location("decode_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_profile", module)
    spec.loader.exec_module(module)
    model = make_tiny(tmp_path / "asr")
    result = module.main(["--model", str(model), "--device", "cpu", "--seconds", "3", "--steps", "4",
                          "--batch", "2", "--out-dir", str(tmp_path)])  # fmt: skip
    assert result["batch"] == 2 and result["steps"] == 4 and result["prompt_tokens"] > 39  # 3 s of audio
    assert result["step_wall_median_ms"] > 0 and result["graph_replay_ms"] is None  # no GPU, no graphs
    assert any(op["name"] == "aten::mm" for op in result["top_host_ops"])
    written = json.loads((tmp_path / "decode_profile_model_b2.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert "Step wall time" in capsys.readouterr().out


def test_busy_time_is_the_union_of_intervals():
    spec = importlib.util.spec_from_file_location("decode_profile_busy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert module._busy_us([]) == 0
