"""benchmarks/soak.py against live servers: a 200-request soak loses nothing, and a loss is caught."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"


def soak(server, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, str(SOAK), "--url", server.url, "--pid", str(server.process.pid),
               "--json", str(out), *args]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return run, json.loads(out.read_text())


def test_200_mixed_requests_with_disconnects_lose_nothing(launch_server, tmp_path):
    with launch_server("soak-server", "--num-kv-pages", "256") as server:
        run, result = soak(server, tmp_path / "soak.json", "--requests", "200", "--concurrency", "16",
                           "--max-tokens", "4", "--disconnect-share", "0.15")  # fmt: skip
        cancelled = re.findall(
            r'^omnistage_requests_total\{.*status="cancelled"\} (\S+)$', server.metrics_text(), re.M
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED" in run.stdout
    assert result["requests"] == 200 and result["lost"] == 0 and result["ok"] + result["disconnected"] == 200
    assert set(result["by_kind"]) == {"chat", "chat_stream", "completion", "completion_stream", "transcription",
                                      "transcription_stream", "media_chat"}  # fmt: skip
    assert result["disconnected"] > 0 and sum(float(c) for c in cancelled) > 0  # the server saw clients leave
    assert result["kv_pages_used"] == 0 and result["running_after"] == 0 and result["waiting_after"] == 0
    assert 0 < result["rss_start_mib"] <= result["rss_peak_mib"]


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
