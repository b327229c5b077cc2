"""The benchmarks' check that serving built nothing: a Triton kernel or torch.compile graph built once serving
has begun (engine/compile_watch.py) stalls the step that needs it, and every request in that step, for tenths of
a second to seconds. `--fail-on-build` makes a benchmark exit non-zero when its run saw one."""

from __future__ import annotations

import argparse
from typing import Any

METRIC = "omnistage_builds_while_serving"


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fail-on-build",
        action="store_true",
        help="exit non-zero when a kernel or graph was built while the benchmark's requests ran (a shape "
        "start-up did not warm; in-process, or counted on the server's /metrics with --url)",
    )


def in_process() -> list[dict[str, Any]]:
    """Each build this process's watch has seen since serving began: what, and its milliseconds."""
    from omnistage.engine.compile_watch import builds_while_serving

    return [{"what": what, "ms": round(seconds * 1e3, 1)} for what, seconds in builds_while_serving()]


def on_server(url: str) -> int:
    """The count of builds a running server reports on /metrics (0 where it reports none)."""
    import httpx

    for line in httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{METRIC} "):
            return int(float(line.split()[1]))
    return 0


def check(args: argparse.Namespace, builds: list[dict[str, Any]] | int) -> None:
    """Under --fail-on-build: exit with the builds listed (a count, from a server or an engine process) when
    there are any."""
    if not args.fail_on_build or not builds:
        return
    if isinstance(builds, int):
        raise SystemExit(
            f"omnistage bench: the engine built {builds} kernels or graphs while serving (its log names them)"
        )
    listed = "; ".join(f"{b['what']} in {b['ms']:.0f} ms" for b in builds)
    raise SystemExit(f"omnistage bench: {len(builds)} kernels or graphs built while serving: {listed}")
