"""The benchmarks' --fail-on-build: what the compile watch saw, in-process or on a server's /metrics."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from omnistage.bench import builds
from omnistage.engine.compile_watch import watch_compiles
from omnistage.server.metrics import ServerMetrics


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    builds.add_argument(parser)
    return parser.parse_args(list(argv))


def test_a_build_while_serving_fails_the_run_only_when_asked() -> None:
    watch_compiles()
    before = len(builds.in_process())

    @torch.compile(backend="eager")
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    shifted(torch.zeros(4))
    seen = builds.in_process()[before:]
    assert len(seen) == 1 and seen[0]["what"].startswith("torch.compile graph") and seen[0]["ms"] >= 0
    builds.check(_args(), seen)  # not asked: the run goes on
    builds.check(_args("--fail-on-build"), [])  # nothing built
    with pytest.raises(SystemExit, match="1 kernels or graphs built while serving: torch.compile graph"):
        builds.check(_args("--fail-on-build"), seen)
    with pytest.raises(SystemExit, match="the engine built 2 kernels or graphs"):
        builds.check(_args("--fail-on-build"), 2)


def test_the_server_count_is_read_from_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    stats = {k: 0 for k in ("num_waiting", "num_running", "kv_pages_total", "kv_pages_used", "kv_pages_free")}
    exposition = ServerMetrics().render(stats | {"builds_while_serving": 3}).decode()
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(text=exposition))
    assert builds.on_server("http://127.0.0.1:1") == 3
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(text="# no such gauge\n"))
    assert builds.on_server("http://127.0.0.1:1") == 0
