"""What the HTTP server costs: the same A2T benchmark through `omnistage serve` and in-process, one run.

Starts `omnistage serve` on random weights at the released sizes, runs `omnistage bench a2t --url` against
it, stops it, then runs the in-process benchmark with the same engine settings, clips, concurrencies and
forced output length, and prints both side by side (RTF and TTFT medians). `--server NAME=FLAGS` adds a
server variant with extra `serve` flags (e.g. `cap80='--gpu-memory-limit-gib 80'`), each started and timed
in turn; `--py-spy` records where each server's threads spend the time (raw py-spy stacks). Each server runs
one benchmark per concurrency, and its /metrics are read before and after each: the mean of every phase of a
request's time to first token at that concurrency (prepare: the body in to the hand-over; to_engine;
first_token; delivery; respond: to the first chunk written), printed beside the in-process run's stage
medians, with the client's own split of its TTFT (upload, response, first_event).
Writes every benchmark's JSON, each server's log and last /metrics, and `phases.json` under --out-dir.

    python benchmarks/serving_overhead.py --out-dir $OUT --concurrency 1,16 --server cap80='--gpu-memory-limit-gib 80'
    python benchmarks/serving_overhead.py --out-dir $OUT --http-clients h11,httpx --server proc=--engine-process
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from omnistage.bench.server_process import ServerProcess, phase_means, phase_totals
from omnistage.bench.skeletons import released_skeleton


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "omnistage.cli", *args]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument(
        "--model", help="checkpoint directory (default: the released sizes' skeleton, random weights)"
    )
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-tokens", type=int, default=33)
    p.add_argument("--synth", default="librispeech")
    p.add_argument("--endpoint", choices=["chat", "transcriptions"], default="chat")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--engine-args", default="", help="engine flags for every target, e.g. '--enforce-eager'")
    p.add_argument("--server", action="append", default=[], metavar="NAME=FLAGS",
                   help="another server variant: extra `serve` flags, after any VAR=value words for its environment")  # fmt: skip
    p.add_argument("--py-spy", action="store_true", help="record each server with py-spy (on PATH)")
    p.add_argument("--http-clients", default="h11",
                   help="the benchmark's HTTP clients, each timed against every server in turn (h11, httpx); a "
                        "server's rows with a client after the first are named NAME+CLIENT")  # fmt: skip
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    model = args.model or released_skeleton()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    max_seqs = str(max(concurrencies))
    engine = ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16", *args.engine_args.split()]

    def bench(concurrency: str) -> list[str]:
        return ["bench", "a2t", "--synth", args.synth, "--concurrency", concurrency,
                "--repeats", str(args.repeats), "--output-tokens", str(args.output_tokens)]  # fmt: skip

    variants = {"http": "", **dict(v.split("=", 1) for v in args.server)}
    clients = args.http_clients.split(",")
    results: dict[str, list[dict]] = {}
    phases: dict[str, dict[int, dict[str, float]]] = {}
    for name, flags in variants.items():
        words = flags.split()
        env = dict(w.split("=", 1) for w in words if "=" in w and w[0].isupper())  # leading VAR=value words
        serve = ["--model", str(model), "--max-num-seqs", max_seqs, "--log-level", "warning", *engine,
                 *(w for w in words if w.split("=", 1)[0] not in env)]  # fmt: skip
        server = ServerProcess(serve, args.out_dir / f"server_{name}.log", port=args.port, env=env)
        spy = None
        try:
            server.wait_ready(timeout=600)
            if args.py_spy:
                spy = subprocess.Popen(["py-spy", "record", "-p", str(server.process.pid), "-f", "raw", "--threads",
                                        "-r", "200", "-o", str(args.out_dir / f"pyspy_{name}.txt")])  # fmt: skip
            for client in clients:
                target = name if client == clients[0] else f"{name}+{client}"
                results[target], phases[target] = [], {}
                for c in concurrencies:
                    out = args.out_dir / f"a2t_{target}_c{c}.json"
                    before = phase_totals(server.url)
                    subprocess.run(
                        _cli(*bench(str(c)), "--url", server.url, "--endpoint", args.endpoint,
                             "--http-client", client, "--out", str(out)),
                        check=True,
                    )  # fmt: skip
                    phases[target][c] = phase_means(before, phase_totals(server.url))
                    results[target] += json.loads(out.read_text())["ours"]
            (args.out_dir / f"metrics_{name}.txt").write_text(
                httpx.get(f"{server.url}/metrics", timeout=10).text
            )
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            server.stop()

    inprocess = args.out_dir / "a2t_inprocess.json"
    subprocess.run(
        _cli(*bench(args.concurrency), "--model", str(model), *engine, "--out", str(inprocess)), check=True
    )
    results["in-process"] = inproc = json.loads(inprocess.read_text())["ours"]
    (args.out_dir / "phases.json").write_text(json.dumps(phases, indent=1))
    print("\n| target | c | RTF (x real time) | / in-process | TTFT median ms | TPOT median ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, passes in results.items():
        for p, i in zip(passes, inproc):
            print(
                f"| {name} | {p['concurrency']} | {p['rtf']:.1f} | {p['rtf'] / i['rtf']:.3f} | "
                f"{p['ttft_median_ms']:.1f} | {p['tpot_median_ms']:.2f} |"
            )
    print(
        "\nTo the first token, mean ms per phase (servers, from /metrics) and median ms per stage (in-process):"
    )
    for name, by_c in phases.items():
        for c, means in by_c.items():
            print(f"  {name} c={c}: " + ", ".join(f"{phase} {ms:.2f}" for phase, ms in means.items()))
    for p in inproc:
        stages = p.get("stages_median_ms", {})
        print(f"  in-process c={p['concurrency']}: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    print(
        "\nThe servers' TTFT as their client saw it, mean ms per stage (upload, response: to the headers, first_event):"
    )
    for name, passes in results.items():
        for p in passes if name != "in-process" else ():
            stages = p.get("stages_mean_ms", {})
            print(f"  {name} c={p['concurrency']}: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))


if __name__ == "__main__":
    main()
