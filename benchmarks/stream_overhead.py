"""What streaming tokens costs the server: a paced stand-in engine behind the real app, HTTP against in-process.

The stand-in pipeline (`PacedPipeline`) takes `--step-ms` a step the way a thread waiting on the GPU does (a
sleep, the GIL let go), after `--host-ms` of Python work that holds the GIL (the engine's host work), and gives
every running request one token a step; it has no model, no media, no tokenizer. The real app (the Gate,
FastAPI, the SSE formats, uvicorn) serves it from a child process, and `--concurrency` clients stream chat
completions of `--tokens` tokens each from it; then the same requests go straight into an AsyncPipeline over the
same stand-in in this process. The engine's step is fixed, so any step the server takes longer than the
in-process one is what the event loop's work for the streams took from the engine thread (the GIL), and the
server's CPU seconds per streamed token say what each token costs it.

    python benchmarks/stream_overhead.py --concurrency 16 --tokens 200 [--loop uvloop --http httptools]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from omnistage.bench.server_process import ServerProcess, phase_means, phase_totals
from omnistage.bench.sweep import run as run_async
from omnistage.errors import InvalidRequest
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.base import Frontend, TtsPrompt
from omnistage.request import GenerationRequest, SamplingParams

MODEL = "paced"


class PacedProcessor:
    """Tokenizes nothing: a chat's prompt is one token per message."""

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool, max_model_len: int):
        return "prompt", list(range(len(messages)))


def speaks_not(text: str) -> TtsPrompt:
    raise InvalidRequest("the paced stand-in does not speak")


class PacedPipeline:
    """Every step: `host_s` of GIL-holding work, then `step_s` asleep, then one token for each running request."""

    def __init__(self, step_s: float, host_s: float) -> None:
        self.step_s, self.host_s = step_s, host_s
        self.config = SimpleNamespace(admission_window_ms=0.0)
        self.frontend = Frontend(Path("/paced"), 4096, PacedProcessor(), speaks_not)
        self.running: dict[str, tuple[SamplingParams, CompletionOutput]] = {}
        self.num_waiting = 0

    def memory_summary(self) -> str:
        return "paced stand-in engine"

    def stats(self) -> dict[str, int]:
        return {"num_waiting": 0, "num_running": len(self.running), "kv_pages_total": 0,
                "kv_pages_free": 0, "kv_pages_used": 0}  # fmt: skip

    def add_requests(self, requests: list) -> list[None]:
        for r in requests:
            self.running[r.request_id] = (r.params, CompletionOutput(index=0, text="", token_ids=[]))
        return [None] * len(requests)

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        time.sleep(self.step_s)
        outputs = []
        for request_id, (params, done) in list(self.running.items()):
            n = len(done.token_ids) + 1
            finished = n >= params.max_tokens
            out = CompletionOutput(
                index=0, text=done.text + " tok", token_ids=[*done.token_ids, n], delta_text=" tok",
                delta_token_ids=[n], finish_reason="length" if finished else None,
            )  # fmt: skip
            self.running[request_id] = (params, out)
            now = time.monotonic()
            metrics = {"arrival": now, "scheduled": now, "first_token": now, "finished": now}
            outputs.append(
                RequestOutput(request_id, "prompt", [0], [out], finished=finished, metrics=metrics)
            )
            if finished:
                del self.running[request_id]
        return outputs


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from omnistage.server import build_app

    engine = AsyncPipeline(PacedPipeline(args.step_ms / 1e3, args.host_ms / 1e3))
    app = build_app(engine, MODEL)
    uvicorn.run(app, port=args.port, log_level="warning", loop=args.loop, http=args.http)


async def over_http(url: str, concurrency: int, tokens: int, body_kb: int) -> list[tuple[float, float]]:
    content = "hi " + "x" * (body_kb * 1000)  # the stand-in's processor reads none of it
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": tokens}).encode()  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient) -> tuple[float, float]:
        start, stamps = time.perf_counter(), []
        async with client.stream("POST", "/v1/chat/completions", content=body, headers=_JSON) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:") and '"content":" tok"' in line:
                    stamps.append(time.perf_counter())
        return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        await one(client)
        return await asyncio.gather(*(one(client) for _ in range(concurrency)))


async def in_process(engine: AsyncPipeline, concurrency: int, tokens: int) -> list[tuple[float, float]]:
    params = SamplingParams(max_tokens=tokens)

    async def one(number: int) -> tuple[float, float]:
        start, stamps = time.perf_counter(), []
        async for _ in engine.generate(GenerationRequest(f"r{number}", [0], params, "prompt")):
            stamps.append(time.perf_counter())
        return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    await one(-1)
    return await asyncio.gather(*(one(i) for i in range(concurrency)))


_JSON = {"content-type": "application/json"}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(name: str, timings: list[tuple[float, float]], cpu_s: float | None, tokens: int) -> dict:
    row = {
        "target": name,
        "ttft_median_ms": round(statistics.median(t for t, _ in timings) * 1e3, 2),
        "tpot_median_ms": round(statistics.median(p for _, p in timings) * 1e3, 3),
    }
    if cpu_s is not None:
        row["server_cpu_us_per_token"] = round(
            cpu_s / ((len(timings) + 1) * tokens) * 1e6, 1
        )  # the warm-up too
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=5.0, help="the stand-in step's time asleep")
    p.add_argument("--host-ms", type=float, default=1.0, help="the stand-in step's GIL-holding work first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--body-kb", type=int, default=0, help="KB of text each request's body carries (a clip's base64)"
    )
    p.add_argument("--loop", default="asyncio", help="uvicorn's event loop (asyncio, uvloop)")
    p.add_argument("--http", default="h11", help="uvicorn's HTTP protocol (h11, httptools)")
    p.add_argument("--port", type=int, default=8013)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return

    rows = []
    command = [sys.executable, __file__, "--serve", "--port", str(args.port), "--step-ms", str(args.step_ms),
               "--host-ms", str(args.host_ms), "--loop", args.loop, "--http", args.http]  # fmt: skip
    server, url = subprocess.Popen(command), f"http://127.0.0.1:{args.port}"
    try:
        ServerProcess.wait_ready(SimpleNamespace(process=server, url=url,
                                                 log_tail=lambda: ""), timeout=60)  # fmt: skip
        for _ in range(args.repeats):
            before, phases = _cpu_seconds(server.pid), phase_totals(url)
            timings = run_async(over_http(url, args.concurrency, args.tokens, args.body_kb))
            cpu = _cpu_seconds(server.pid) - before
            rows.append(_summary(f"http ({args.loop}, {args.http})", timings, cpu, args.tokens))
            rows[-1]["phases_mean_ms"] = {
                k: round(v, 2) for k, v in phase_means(phases, phase_totals(url)).items()
            }
            print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait()
    engine = AsyncPipeline(PacedPipeline(args.step_ms / 1e3, args.host_ms / 1e3))
    try:
        for _ in range(args.repeats):
            rows.append(_summary("in-process", run_async(in_process(engine, args.concurrency, args.tokens)),
                                 None, args.tokens))  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        engine.shutdown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
