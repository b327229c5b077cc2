"""Qwen3-ASR replicas on Ray Serve against the single server, on one machine: audio seconds per second at one
concurrency, and what the Ray ingress adds to a lone request's first token.

Each target is one `part`, run in its own process (benchmarks/ray_asr.sh gives each its own timeout):

- `part single`: `omnistage serve` on the checkpoint, then `omnistage bench a2t --url` at c = 1 and the
  throughput concurrency (33 tokens forced on random weights, as benchmarks/asr.sh);
- `part ray --replicas N`: `omnistage serve --ray` with N replicas sharing the machine, each 1/N of the GPU
  (`--replica-gpus`), 1/N of the CPUs Ray counts (`--replica-cpus`, which Ray also makes each replica's
  OMP_NUM_THREADS) and, beside other replicas, 1/N of `--memory-gib` (`--gpu-memory-limit-gib`); the same
  benchmark through Serve's proxy once all N replicas have answered (`--ttft` adds the c = 1 pass).

Before the clock, each target takes a few requests one at a time for each replica it has.

Each part writes `part_<target>.json` (its passes, as `bench a2t` reports them, its flags and its start time)
and the server's log under --out-dir; `table` prints every part found there as rows beside the single
server's, and the ingress' overhead at c = 1 (`--json` gathers the parts into one file).

    python benchmarks/ray_asr.py part single --out-dir OUT
    python benchmarks/ray_asr.py part ray --replicas 2 --out-dir OUT
    python benchmarks/ray_asr.py table --out-dir OUT
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from omnistage.bench.server_process import ServerProcess
from omnistage.bench.skeletons import released_skeleton

REPLICA_HEADER = "x-omnistage-replica"
WARMUP_PER_REPLICA = 4


def replica_flags(replicas: int, cpus: int, gpu: bool, memory_gib: float | None) -> list[str]:
    """`omnistage serve --ray`'s flags for `replicas` equal shares of one machine: of its GPU (a fraction Ray
    accepts, at most 4 decimals), of the `cpus` Ray counts (at least one each) and, when they share the card,
    of `memory_gib` (a lone replica plans its memory as the single server does)."""
    flags = ["--ray", "--replicas", str(replicas), "--replica-cpus", str(max(1, cpus // replicas))]
    flags += ["--replica-gpus", str(math.floor(10_000 / replicas) / 10_000 if gpu else 0)]
    if gpu and replicas > 1 and memory_gib:
        flags += ["--gpu-memory-limit-gib", f"{memory_gib / replicas:g}"]
    return flags


def wait_replicas(url: str, replicas: int, server: ServerProcess, timeout: float) -> list[str]:
    """Once /health through the ingress has been answered by `replicas` distinct replicas, their ids: Serve's
    proxy routes to a replica as soon as one is up, and the benchmark wants all of them."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            response = httpx.get(f"{url}/health", timeout=2)
        except httpx.TransportError:
            response = None
        if response is not None and response.status_code == 200 and REPLICA_HEADER in response.headers:
            seen.add(response.headers[REPLICA_HEADER])
            if len(seen) >= replicas:
                return sorted(seen)
        time.sleep(0.05 if seen else 0.5)
    raise RuntimeError(f"{len(seen)} of {replicas} replicas answered in {timeout} s:\n{server.log_tail()}")


def stop_tree(server: ServerProcess, grace_s: float = 10.0) -> None:
    """Stop the server and every process under it: a Ray head started by `serve --ray` runs its GCS, raylet
    and replicas as the server's descendants, and a replica left holding the GPU would skew the next part.
    What has not exited `grace_s` after the server's SIGTERM is killed."""
    import psutil  # here only: the tests of the arithmetic above run without it

    try:
        tree = [psutil.Process(server.process.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    server.process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    server.process.wait()


def model_flags(model: str) -> list[str]:
    """`--model` flags: a checkpoint directory, `tiny` (a tiny Qwen3-ASR checkpoint made here, for a CPU smoke
    run) or `released` (random weights at Qwen3-ASR 0.6B's released sizes)."""
    if model == "tiny":
        from omnistage.models.qwen3_asr.tiny import make_tiny

        return ["--model", str(make_tiny(tempfile.mkdtemp(prefix="omnistage-tiny-asr-")))]
    if model == "released":
        return ["--model", str(released_skeleton("qwen3-asr-0.6b")), "--load-format", "dummy"]
    return ["--model", model]


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    target = "single" if args.target == "single" else f"ray{args.replicas}"
    concurrencies = ([1] if args.ttft else []) + [args.concurrency]
    serve = [*model_flags(args.model), "--device", args.device, "--max-num-seqs", str(args.concurrency),
             "--log-level", "warning", *args.serve_flags.split()]  # fmt: skip
    if args.target == "ray":
        from ray._private.utils import get_num_cpus

        serve += replica_flags(args.replicas, get_num_cpus(), args.device == "cuda", args.memory_gib)
    out = args.out_dir / f"a2t_{target}.json"
    started = time.monotonic()
    server = ServerProcess(serve, args.out_dir / f"server_{target}.log")
    try:
        server.wait_ready(timeout=args.ready_timeout)
        replicas = []
        if args.target == "ray":
            remaining = args.ready_timeout - (time.monotonic() - started)
            replicas = wait_replicas(server.url, args.replicas, server, max(remaining, 1.0))
        start_s = time.monotonic() - started
        bench = [sys.executable, "-m", "omnistage.cli", "bench", "a2t", "--url", server.url,
                 "--synth", args.synth, "--concurrency", ",".join(map(str, concurrencies)),
                 "--repeats", str(args.repeats), "--output-tokens", str(args.output_tokens), "--out", str(out)]  # fmt: skip
        if args.limit:
            bench += ["--limit", str(args.limit)]
        # requests one at a time before the clock: a few for each replica (drawn at random) to meet its first
        bench += ["--warmup", str(WARMUP_PER_REPLICA * max(1, args.replicas))]
        subprocess.run(bench, check=True)
    finally:
        stop_tree(server)
    part = {
        "target": target,
        "replicas": args.replicas if args.target == "ray" else 0,
        "replica_ids": replicas,
        "serve_flags": serve,
        "start_s": round(start_s, 1),
        "passes": json.loads(out.read_text())["ours"],
    }
    (args.out_dir / f"part_{target}.json").write_text(json.dumps(part, indent=1) + "\n")
    return part


def table(parts: list[dict[str, Any]]) -> list[str]:
    """Rows of every part's passes, the single server's first: audio seconds per second, its ratio to the
    single server's at the same c, TTFT and TPOT medians; then the ingress' overhead on a lone request (the
    c = 1 TTFT median through one replica on Ray less the single server's)."""
    parts = sorted(parts, key=lambda p: p["replicas"])
    single = next((p for p in parts if p["target"] == "single"), None)
    base = {p["concurrency"]: p["rtf"] for p in single["passes"]} if single else {}
    lines = [
        "| target | replicas | c | audio s/s | / single | TTFT median ms | TTFT p90 ms | TPOT median ms | start s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for part in parts:
        for p in part["passes"]:
            ratio = f"{p['rtf'] / base[p['concurrency']]:.3f}" if p["concurrency"] in base else "-"
            lines.append(
                f"| {part['target']} | {part['replicas'] or '-'} | {p['concurrency']} | {p['rtf']:.1f} | {ratio} | "
                f"{p['ttft_median_ms']:.1f} | {p['ttft_p90_ms']:.1f} | {_ms(p['tpot_median_ms'])} | {part['start_s']:.0f} |"
            )
    lone = {part["target"]: _ttft_at_1(part) for part in parts}
    if lone.get("single") is not None and lone.get("ray1") is not None:
        lines.append(
            f"\nRay ingress at c=1: TTFT median {lone['ray1']:.1f} ms through one replica vs {lone['single']:.1f} ms "
            f"on the single server: {lone['ray1'] - lone['single']:+.1f} ms"
        )
    return lines


def _ttft_at_1(part: dict[str, Any]) -> float | None:
    return next((p["ttft_median_ms"] for p in part["passes"] if p["concurrency"] == 1), None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    part = sub.add_parser("part", help="one target: start it, benchmark it, stop it")
    part.add_argument("target", choices=["single", "ray"])
    part.add_argument("--replicas", type=int, default=1)
    part.add_argument("--model", default="released",
                      help="checkpoint directory, `released` (Qwen3-ASR 0.6B's sizes, random weights) or `tiny`")  # fmt: skip
    part.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    part.add_argument(
        "--concurrency", type=int, default=128, help="the throughput pass's (default: %(default)s)"
    )
    part.add_argument("--ttft", action="store_true", help="also a pass at c = 1")
    part.add_argument("--repeats", type=int, default=3)
    part.add_argument("--output-tokens", type=int, default=33)
    part.add_argument("--synth", default="librispeech")
    part.add_argument("--limit", type=int, help="only the first N clips")
    part.add_argument("--memory-gib", type=float, help="GPU memory the replicas share, 1/N each (N > 1)")
    part.add_argument("--ready-timeout", type=float, default=240.0, help="to every replica up (s)")
    part.add_argument("--serve-flags", default="", help="more `omnistage serve` flags for the target")
    part.add_argument("--out-dir", type=Path, required=True)
    tab = sub.add_parser("table", help="the parts' rows")
    tab.add_argument("--out-dir", type=Path, required=True)
    tab.add_argument("--json", type=Path, help="also write every part found, as one JSON list, here")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.command == "part":
        # `timeout` sends SIGTERM: exit through the finally that stops the server and its processes
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
        run_part(args)
    parts = [json.loads(f.read_text()) for f in sorted(args.out_dir.glob("part_*.json"))]
    if args.command == "table" and args.json:
        args.json.write_text(json.dumps(parts, indent=1) + "\n")
    print("\n".join(table(parts)))


if __name__ == "__main__":
    main()
