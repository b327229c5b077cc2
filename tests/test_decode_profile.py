"""benchmarks/decode_profile.py: a CPU smoke run over a tiny Qwen3-ASR checkpoint."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_profile.py"


def test_decode_profile_smoke(tmp_path, monkeypatch, capsys):
    from omnistage.models.qwen3_asr.tiny import make_tiny

    spec = importlib.util.spec_from_file_location("decode_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_profile", module)
    spec.loader.exec_module(module)
    model = make_tiny(tmp_path / "asr")
    monkeypatch.setattr(module, "SITE_CALLS", ("aten::mm",))  # no CUDA call here: the sites of the matmuls
    result = module.main(["--model", str(model), "--device", "cpu", "--seconds", "3", "--steps", "4",
                          "--batch", "2", "--arrivals", "1", "--out-dir", str(tmp_path)])  # fmt: skip
    assert result["batch"] == 2 and result["steps"] == 4 and result["prompt_tokens"] > 39  # 3 s of audio
    assert result["step_wall_median_ms"] > 0 and result["graph_replay_ms"] is None  # no GPU, no graphs
    assert any(op["name"] == "aten::mm" for op in result["top_host_ops"])
    # the profiler's Python stacks name the model's lines that ran them
    assert any(
        site["call"] == "aten::mm" and site["site"].startswith("models/")
        for site in result["host_call_sites"]
    )
    assert (
        result["loaded"]["arrivals"] == 1 and result["loaded"]["decoding_after"] == 2
    )  # the batch decodes on
    written = json.loads((tmp_path / "decode_profile_model_b2_a1.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert "Step wall time" in capsys.readouterr().out


def test_busy_time_is_the_union_of_intervals():
    spec = importlib.util.spec_from_file_location("decode_profile_busy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert module._busy_us([]) == 0


class Event:
    def __init__(self, name, us, parent=None, stack=(), at=(0, 0), thread=1):
        self.name, self.self_cpu_time_total, self.cpu_parent, self.stack = name, us, parent, list(stack)
        self.time_range, self.thread = SimpleNamespace(start=at[0], end=at[1]), thread


def test_host_calls_are_summed_by_the_omnistage_lines_that_asked_for_them():
    spec = importlib.util.spec_from_file_location("decode_profile_sites", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    frames = ["/x/torch/nn.py(3): f", "/w/omnistage/engine/a.py(10): copy", "/w/omnistage/engine/b.py(20): step",
              "/w/omnistage/pipeline/c.py(30): run"]  # fmt: skip
    copy = Event(
        "aten::copy_", 5.0, Event("aten::to", 1.0, stack=frames), stack=[]
    )  # its stack on the parent
    other = Event("aten::copy_", 1.0, stack=["/w/omnistage/engine/d.py(4): keys"])
    events = [
        Event("cudaMemcpyAsync", 100.0, copy),
        Event("cudaMemcpyAsync", 60.0, copy),
        Event("cudaMemcpyAsync", 7.0, other),
        Event("cudaHostRegister", 150.0, Event("aten::empty", 1.0)),  # no omnistage frame above it
        Event("cudaLaunchKernel", 999.0, copy),  # not a call it sums
    ]
    sites = module._sites(events, steps=2)
    assert sites == [
        {"call": "cudaMemcpyAsync", "site": "engine/a.py(10): copy < engine/b.py(20): step", "per_step": 1.0,
         "us_per_step": 80.0},
        {"call": "cudaHostRegister", "site": "(no omnistage frame)", "per_step": 0.5, "us_per_step": 75.0},
        {"call": "cudaMemcpyAsync", "site": "engine/d.py(4): keys", "per_step": 0.5, "us_per_step": 3.5},
    ]  # fmt: skip


def test_runtime_calls_linked_to_no_parent_are_placed_by_the_calls_enclosing_them():
    spec = importlib.util.spec_from_file_location("decode_profile_enclosing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    events = [
        Event("/w/omnistage/pipeline/step_loop.py(9): step", 0.0, at=(0, 200)),
        Event("/w/omnistage/engine/stages/text.py(40): _prefill", 0.0, at=(5, 9)),  # ended before the copy
        Event("/w/omnistage/engine/stages/text.py(50): _sample_step", 0.0, at=(10, 100)),
        Event("aten::copy_", 0.0, at=(20, 30)),  # no omnistage frame of its own
        Event("/w/omnistage/engine/other.py(1): elsewhere", 0.0, at=(0, 300), thread=2),  # another thread
        Event("cudaMemcpyAsync", 12.0, at=(22, 25)),
        Event("cudaMemcpyAsync", 4.0, at=(150, 151)),
        Event("cudaEventSynchronize", 3.0, at=(400, 401)),  # outside every call of its thread
    ]
    assert module._sites(events, steps=1) == [
        {"call": "cudaMemcpyAsync", "site": "engine/stages/text.py(50): _sample_step < pipeline/step_loop.py(9): step",
         "per_step": 1.0, "us_per_step": 12.0},
        {"call": "cudaMemcpyAsync", "site": "pipeline/step_loop.py(9): step", "per_step": 1.0, "us_per_step": 4.0},
        {"call": "cudaEventSynchronize", "site": "(no omnistage frame)", "per_step": 1.0, "us_per_step": 3.0},
    ]  # fmt: skip
