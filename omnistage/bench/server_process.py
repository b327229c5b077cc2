"""An `omnistage serve` subprocess that benchmarks and tests start, wait for and stop, and the request phases
its /metrics report."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerProcess:
    """`omnistage serve ARGS` on `port` (a free one by default); its output goes to `log`."""

    def __init__(
        self, args: list[str], log: Path, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        command = [sys.executable, "-m", "omnistage.cli", "serve", "--port", str(port), *args]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        """Return once /health answers 200; raise RuntimeError with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def phase_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each phase of `omnistage_request_phase_seconds` on the server's /metrics now."""
    totals: dict[str, list[float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for field, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith(f"omnistage_request_phase_seconds{field}"):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                totals.setdefault(phase, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {phase: (total, count) for phase, (total, count) in totals.items()}


def phase_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean ms of each phase over the requests observed between two readings."""
    means = {}
    for phase, (total, count) in after.items():
        total_before, count_before = before.get(phase, (0.0, 0.0))
        if count > count_before:
            means[phase] = (total - total_before) / (count - count_before) * 1e3
    return means
