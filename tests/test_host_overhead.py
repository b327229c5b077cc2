"""benchmarks/host_overhead.py: a CPU smoke run of the decode-step host benchmark over its stand-in decoder."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "host_overhead.py"


@pytest.fixture
def host_overhead(monkeypatch):
    spec = importlib.util.spec_from_file_location("host_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "host_overhead", module)
    spec.loader.exec_module(module)
    return module


def test_host_overhead_smoke(host_overhead, tmp_path, capsys):
    out = tmp_path / "host.json"
    results = host_overhead.main(["--batches", "1,3", "--steps", "4", "--warmup", "2", "--prompt-len", "40",
                                  "--profile-top", "3", "--json", str(out)])  # fmt: skip
    assert [(r["mode"], r["batch"]) for r in results] == [
        ("greedy", 1),
        ("greedy", 3),
        ("sampled", 1),
        ("sampled", 3),
    ]
    assert all(r["median_ms"] > 0 for r in results)
    # served gaps need tokens that arrive apart: a greedy step of the stand-in takes ~0.1 ms, and a loaded
    # machine's event loop may take a request's 8 tokens in one output; a sampled step takes milliseconds
    assert all(r["served_median_ms"] > 0 for r in results if r["mode"] == "sampled")
    assert all(r.get("served_median_ms", 1) > 0 for r in results)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    assert "own us/step" in printed and "served ms" in printed


def test_the_stand_in_decodes_ordinary_text_to_the_end(host_overhead):
    from omnistage import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="float32", page_size=4, num_kv_pages=64)
    host_overhead.install_no_op(llm.engine, 512)
    allowed = set(host_overhead.ordinary_tokens(llm.engine, 512))
    params = SamplingParams(max_tokens=30, temperature=0.0)
    first, again = (
        llm.generate({"prompt_token_ids": [300, 301, 302]}, params)[0].outputs[0] for _ in range(2)
    )
    assert first.finish_reason == "length" and set(first.token_ids) <= allowed
    assert first.token_ids == again.token_ids and "\ufffd" not in first.text
