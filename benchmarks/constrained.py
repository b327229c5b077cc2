"""Constrained decoding's cost and a Thinking model's streamed reasoning, at the released sizes (random weights
with `--load-format dummy`); benchmarks/constrained.sh runs both parts on the GPU.

    python benchmarks/constrained.py decode --out-dir OUT     # TPOT, json_schema against free, in-process
    python benchmarks/constrained.py thinking --out-dir OUT   # a streamed Thinking chat through `omnistage serve`

decode: the Qwen3-Omni Thinker (no Talker) in this process; per batch, passes of that many requests with
distinct prompts, each forced to decode `--tokens` tokens (min_tokens = max_tokens, ignore_eos, greedy): one
pass free, one under `response_format: json_schema` (a list of at least 64 records, which no output completes
within 319 tokens: every request of every side runs to its `max_tokens`, and the run checks it) and one free
without decoding ahead (what decoding ahead is worth: a constrained step decodes ahead too, its mask filled
while its forward pass runs), in turn, after a warm-up of each. Per request TPOT = (finished - first token) / (tokens - 1); medians over all passes.

thinking: a Thinking checkpoint (the Thinker alone, no Talker: the server's reasoning parser is on by default)
whose chat template opens the think block, served over HTTP; streamed chats forced to `--tokens` tokens at each
concurrency, with the think block open (every token is reasoning: random weights never close it, so the deltas
are `reasoning_content`) and with `chat_template_kwargs: {"enable_thinking": false}` (an empty block closed in
the prompt: every delta is `content`). TTFT to the first delta with text, TPOT over the usage's tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omnistage.bench import builds
from omnistage.bench.clients import JSON_HEADERS, events, first_model
from omnistage.bench.constrained import (
    RATIO_HEADER,
    StreamedReply,
    longest_forced_length,
    ratio_row,
    records_constraint,
    thinking_checkpoint,
)
from omnistage.bench.server_process import ServerProcess
from omnistage.bench.skeletons import released_skeleton
from omnistage.bench.sse_client import StreamClient
from omnistage.bench.stats import RequestTiming, json_safe, median, summarize
from omnistage.bench.sweep import run as run_async
from omnistage.bench.sweep import sweep

log = logging.getLogger("bench")


def timed_pass(
    llm: Any, prompts: list[str], params: Any, decode_ahead: bool
) -> tuple[list[RequestTiming], float, str]:
    """One pass of `prompts` at once, decoding ahead or not: each request's timing, the pass's wall time, the
    first reply's text. Raises if a request decoded other than `params.max_tokens` tokens, or stopped before."""
    llm.engine.decode_ahead = decode_ahead
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    timings = []
    for out in outputs:
        done, m = out.outputs[0], out.metrics
        if len(done.token_ids) != params.max_tokens or done.finish_reason != "length":
            raise RuntimeError(
                f"a request decoded {len(done.token_ids)} tokens ({done.finish_reason}), not "
                f"{params.max_tokens}: {done.text[:200]!r}"
            )
        timings.append(
            RequestTiming(
                0.0, m["first_token"] - m["arrival"], m["finished"] - m["arrival"], len(done.token_ids)
            )
        )
    return timings, wall, outputs[0].outputs[0].text


def decode(args: argparse.Namespace) -> None:
    from omnistage import LLM, SamplingParams

    if args.tokens > longest_forced_length():
        raise SystemExit(f"--tokens: at most {longest_forced_length()}, or a constrained reply may complete")
    batches = [int(b) for b in args.batches.split(",")]
    model = str(args.model or released_skeleton())
    options = {"kv_cache_memory_gib": args.kv_gib} if args.kv_gib else {}
    started = time.perf_counter()
    llm = LLM(
        model=model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        speech=False,  # the Thinker alone: a Talker's weights and pages stay off the GPU
        max_num_seqs=max(batches),
        **options,
    )
    results: dict[str, Any] = {
        "model": model,
        "engine_start_s": round(time.perf_counter() - started, 2),
        "engine": llm.engine.memory_summary(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "batches": {},
    }
    log.info("engine ready in %.1f s: %s", results["engine_start_s"], results["engine"])
    print(f"decode: the Thinker in-process, started in {results['engine_start_s']} s", flush=True)
    print(RATIO_HEADER, flush=True)  # each row as its batch ends: a run cut short keeps what it measured
    free = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    # A constrained step decodes ahead, its mask filled from the token before while its forward pass runs: the
    # third side, free but one step at a time, is what it would cost without.
    constrained = dataclasses.replace(free, structured=records_constraint())
    sides = {"free": (free, True), "json_schema": (constrained, True), "free, not ahead": (free, False)}
    for batch in batches:
        prompts = [f"Office {i}: list its staff as JSON records." for i in range(batch)]
        for params, ahead in sides.values():  # warm-up: the schema compiles on its first request
            timed_pass(llm, prompts, params, ahead)
        timings: dict[str, list[RequestTiming]] = {name: [] for name in sides}
        walls: dict[str, list[float]] = {name: [] for name in sides}
        replies: dict[str, str] = {}
        for _ in range(args.repeats):
            for name, (params, ahead) in sides.items():
                t, wall, replies[name] = timed_pass(llm, prompts, params, ahead)
                timings[name] += t
                walls[name].append(wall)
        summaries = {name: summarize(timings[name], walls[name], batch) for name in sides}
        for name, summary in summaries.items():
            summary["first_reply"] = replies[name]
        results["batches"][batch] = summaries
        write(args.out_dir / "decode.json", results)
        row = ratio_row(
            batch, args.tokens, summaries["free"], summaries["json_schema"], summaries["free, not ahead"]
        )
        print(row, flush=True)
    llm.engine.decode_ahead = sides["free"][1]
    results["builds_while_serving"] = builds.in_process()
    write(args.out_dir / "decode.json", results)
    print(f"decode: builds while serving: {len(results['builds_while_serving'])}", flush=True)


THINKING_HEADER = (
    "| template | c | tokens each | TTFT ms | TPOT ms | reasoning deltas | content deltas | order |\n"
    "|---|---|---|---|---|---|---|---|"
)
MODES = {"thinking": {}, "enable_thinking false": {"chat_template_kwargs": {"enable_thinking": False}}}


def stream_summary(replies: list[StreamedReply], walls: list[float], concurrency: int) -> dict[str, Any]:
    summary = summarize([r.timing() for r in replies], walls, concurrency)
    summary["tokens_each"] = sorted({r.completion_tokens for r in replies})
    summary["reasoning_deltas_median"] = median([float(r.count("reasoning")) for r in replies])
    summary["content_deltas_median"] = median([float(r.count("content")) for r in replies])
    summary["orders"] = sorted({r.order for r in replies})
    return summary


async def thinking_sweep(url: str, args: argparse.Namespace, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed chats at each concurrency, `extra` fields in every request."""
    model = first_model(url, None)
    client = StreamClient(url)
    forced = {"max_tokens": args.tokens, "min_tokens": args.tokens, "ignore_eos": True, "temperature": 0.0}

    async def one(_: str, number: int) -> StreamedReply:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Question {number}: why is the sky blue?"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            **forced,
            **extra,
        }
        reply = StreamedReply(time.perf_counter())
        async for event in events(
            client, "/v1/chat/completions", json.dumps(body).encode(), JSON_HEADERS, {}
        ):
            reply.add(event)
        return reply

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    try:
        return await sweep(
            one, ["chat"], concurrencies, stream_summary, count=lambda c: c, repeats=args.repeats
        )
    finally:
        client.close()


def thinking(args: argparse.Namespace) -> None:
    directory = thinking_checkpoint(Path(tempfile.mkdtemp(prefix="omnistage-thinking-")), args.model)
    flags = ["--model", str(directory), "--load-format", args.load_format, "--device", args.device]
    flags += ["--dtype", args.dtype, "--max-num-seqs", str(max(int(c) for c in args.concurrency.split(",")))]
    if args.kv_gib:
        flags += ["--kv-cache-memory-gib", str(args.kv_gib)]
    started = time.perf_counter()
    server = ServerProcess(flags, args.out_dir / "thinking_server.log")
    try:
        server.wait_ready(args.server_timeout)
        results: dict[str, Any] = {
            "model": str(directory),
            "server_ready_s": round(time.perf_counter() - started, 2),
        }
        print(f"thinking: `omnistage serve` ready in {results['server_ready_s']} s", flush=True)
        print(THINKING_HEADER, flush=True)
        results["modes"] = {}
        for (
            mode,
            extra,
        ) in MODES.items():  # each mode's rows as it ends: a run cut short keeps what it measured
            passes = results["modes"][mode] = run_async(thinking_sweep(server.url, args, extra))
            write(args.out_dir / "thinking.json", results)
            for s in passes:
                print(
                    f"| {mode} | {s['concurrency']} | {','.join(map(str, s['tokens_each']))} | "
                    f"{s['ttft_median_ms']:.1f} | {s['tpot_median_ms']:.2f} | {s['reasoning_deltas_median']:.0f} | "
                    f"{s['content_deltas_median']:.0f} | {' '.join(s['orders'])} |",
                    flush=True,
                )
        results["builds_while_serving"] = builds.on_server(server.url)
        write(args.out_dir / "thinking.json", results)
        print(f"thinking: builds while serving: {results['builds_while_serving']}", flush=True)
    finally:
        server.stop()


def write(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(json_safe(results), indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["decode", "thinking"])
    parser.add_argument("--model", type=Path, help="a checkpoint (default: the released sizes, no weights)")
    parser.add_argument("--load-format", default="dummy", help="dummy: random weights (default: %(default)s)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-gib", type=float, help="the Thinker's KV pool (default: planned)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens every request decodes")
    parser.add_argument("--batches", default="1,32", help="decode: requests in a pass")
    parser.add_argument("--concurrency", default="1,32", help="thinking: streams at once")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes after the warm-up")
    parser.add_argument(
        "--server-timeout", type=float, default=150.0, help="thinking: seconds to wait for it"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # `timeout` ends a part with SIGTERM: exit through the `finally`s, so that the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.part == "decode":
        decode(args)
    else:
        thinking(args)


if __name__ == "__main__":
    main()
