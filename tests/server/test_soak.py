"""benchmarks/soak.py against live servers: a 200-request soak loses nothing, and a loss is caught."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", SOAK)
soak_module = sys.modules["soak"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(soak_module)


def soak(server, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, str(SOAK), "--url", server.url, "--pid", str(server.process.pid),
               "--json", str(out), *args]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return run, json.loads(out.read_text())


def test_200_mixed_requests_with_disconnects_lose_nothing(launch_server, tmp_path):
    with launch_server("soak-server", "--num-kv-pages", "256") as server:
        run, result = soak(server, tmp_path / "soak.json", "--requests", "200", "--concurrency", "16",
                           "--max-tokens", "4", "--disconnect-share", "0.15", "--rss-every", "50")  # fmt: skip
        cancelled = re.findall(
            r'^omnistage_requests_total\{.*status="cancelled"\} (\S+)$', server.metrics_text(), re.M
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED" in run.stdout
    assert result["requests"] == 200 and result["lost"] == 0 and result["ok"] + result["disconnected"] == 200
    assert set(result["by_kind"]) == {"chat", "chat_stream", "completion", "completion_stream", "transcription",
                                      "transcription_stream", "media_chat", "video_chat"}  # fmt: skip
    assert result["disconnected"] > 0 and sum(float(c) for c in cancelled) > 0  # the server saw clients leave
    assert result["kv_pages_used"] == 0 and result["running_after"] == 0 and result["waiting_after"] == 0
    assert 0 < result["rss_start_mib"] <= result["rss_peak_mib"]
    # the RSS from the server's /metrics every 50 requests, with the plateau verdict over the series
    assert result["rss_source"] == "/metrics" and result["rss_every"] == 50
    assert [done for done, _ in result["rss_series_mib"]] == [0, 50, 100, 150, 200]
    assert result["rss_series_mib"][0][1] == result["rss_start_mib"]
    assert result["rss_series_mib"][-1][1] == result["rss_end_mib"]
    assert result["rss_verdict"] in ("plateaus", "still growing")
    assert "server RSS every 50 requests (requests done: MiB, from /metrics): 0: " in run.stdout


def test_a_refused_request_fails_the_soak(launch_server, tmp_path):
    # One sequence at a time and one waiting: most of 8 concurrent requests get 503.
    with launch_server(
        "soak-refusing-server", "--num-kv-pages", "64", "--max-num-seqs", "1", "--max-queue", "1"
    ) as server:
        run, result = soak(server, tmp_path / "soak.json", "--requests", "24", "--concurrency", "8",
                           "--max-tokens", "4", "--disconnect-share", "0")  # fmt: skip
    assert run.returncode == 1
    assert result["lost"] > 0 and any("HTTP 503" in reason for reason in result["lost_reasons"])
    assert "FAILED" in run.stdout and f"{result['lost']} requests lost" in run.stdout


def test_the_rss_verdict_tells_a_warm_up_from_a_leak():
    warm_up = [(0, 800.0), (200, 1100.0), (400, 1230.0), (600, 1236.0), (800, 1238.0), (1000, 1239.0)]
    assert soak_module.plateau(warm_up) == (436.0, 3.0, "plateaus")
    leak = [(0, 800.0), (200, 900.0), (400, 1000.0), (600, 1100.0)]  # 0.5 MiB a request throughout
    assert soak_module.plateau(leak) == (200.0, 100.0, "still growing")
    slowing = [(0, 800.0), (200, 1000.0), (400, 1040.0)]  # 40 MiB over the second half, a fifth the rate
    assert soak_module.plateau(slowing)[2] == "plateaus"
    assert soak_module.plateau([(0, 800.0), (200, 1000.0)])[2] == "too few samples"
