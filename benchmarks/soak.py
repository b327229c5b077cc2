"""Soak a server with mixed requests, some cut off by their clients, and check that nothing is lost.

N requests at concurrency C, each picked (seeded) among chat, streamed chat, completions, streamed
completions, transcriptions (json and streamed), chat with an audio clip and an image, and chat with a video
and its sound. Every request forces its output length (min_tokens = max_tokens, ignore_eos), so each
answer's token count is checked. A share of the requests is cut off on purpose: a stream closed after its first event, or a non-streamed
request abandoned after a few milliseconds. Every other request must end with a whole, well-formed
answer; anything else (an HTTP error, a reset connection, a stream cut short, a wrong token count) is
lost. After the run every KV page must be free again and nothing running or waiting (/metrics), and the
server's resident memory may have grown by at most --max-rss-growth-mib since the warm-up.

The server's RSS is sampled every --rss-every requests (from /metrics' process_resident_memory_bytes, else
/proc/<--pid>) and printed as a series with a verdict: it "plateaus" when the run's second half grew it by at
most 16 MiB or at under half the first half's rate per request (a warm-up: allocator arenas, caches filling),
else it is "still growing" (a leak), which fails the soak with --require-plateau. Under `serve
--engine-process` that is the HTTP process's memory only, not the engine's.

Prints a summary; writes it as JSON with --json; exits 1 if anything failed.

    python benchmarks/soak.py --requests 1000 --concurrency 64            # starts a tiny-model server
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 4242      # an existing server
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
from PIL import Image

from omnistage.bench.server_process import ServerProcess
from omnistage.bench.videos import encode, frames

KINDS = {  # kind: weight in the mix
    "chat": 3,
    "chat_stream": 3,
    "completion": 2,
    "completion_stream": 2,
    "transcription": 1,
    "transcription_stream": 1,
    "media_chat": 1,
    "video_chat": 1,
}
STREAMED = {"chat_stream", "completion_stream", "transcription_stream"}


@dataclass
class Outcome:
    kind: str
    result: str  # "ok", "disconnected" (on purpose) or "lost"
    seconds: float
    reason: str = ""


@dataclass
class Workload:
    """What a run needs to build its requests."""

    model: str
    max_tokens: int
    disconnect_share: float
    rng: random.Random
    wav: bytes = field(default_factory=lambda: _tone_wav(1.0))
    png_url: str = field(default_factory=lambda: _png_data_url(64, 48))
    # 1 s of 64x48 at 10 fps with a tone, its sound interleaved with its frames (use_audio_in_video)
    mp4_url: str = field(
        default_factory=lambda: (
            "data:video/mp4;base64," + base64.b64encode(encode(frames(10, 64, 48), fps=10)).decode()
        )
    )


def _tone_wav(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def _png_data_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 80, 20)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# -- one request --------------------------------------------------------------------------------------------


class Lost(Exception):
    """The request did not end as it should have."""


async def one_request(client: httpx.AsyncClient, workload: Workload, kind: str) -> Outcome:
    tokens = workload.rng.randint(1, workload.max_tokens)
    cut = workload.rng.random() < workload.disconnect_share
    abandon_after = workload.rng.uniform(0.001, 0.05)
    start = time.perf_counter()
    try:
        if kind in STREAMED:
            finished = await _streamed(client, workload, kind, tokens, cut)
        else:
            call = _whole(client, workload, kind, tokens)
            finished = await (_abandoned(call, abandon_after) if cut else call)
    except Lost as exc:
        return Outcome(kind, "lost", time.perf_counter() - start, str(exc))
    except httpx.HTTPError as exc:
        return Outcome(kind, "lost", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    return Outcome(kind, "ok" if finished else "disconnected", time.perf_counter() - start)


async def _abandoned(call: Awaitable[bool], after: float) -> bool:
    """The call's result if it ends within `after` seconds; else it is cancelled (its connection closed)."""
    try:
        return await asyncio.wait_for(call, after)
    except TimeoutError:
        return False


def _forced(tokens: int) -> dict[str, Any]:
    return {"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True, "temperature": 0.0}


def _chat_body(workload: Workload, kind: str, tokens: int) -> dict[str, Any]:
    content: Any = f"Say something about the number {workload.rng.randint(0, 10**6)}."
    if kind == "media_chat":
        audio = {"data": base64.b64encode(workload.wav).decode(), "format": "wav"}
        content = [
            {"type": "input_audio", "input_audio": audio},
            {"type": "image_url", "image_url": {"url": workload.png_url}},
            {"type": "text", "text": "What do you hear and see?"},
        ]
    extra: dict[str, Any] = {}
    if kind == "video_chat":
        content = [
            {"type": "video_url", "video_url": {"url": workload.mp4_url}},
            {"type": "text", "text": "What happens, and what is heard?"},
        ]
        extra = {"use_audio_in_video": True}
    messages = [{"role": "user", "content": content}]
    return {"model": workload.model, "messages": messages, **_forced(tokens), **extra}


def _form(workload: Workload, tokens: int, stream: bool) -> dict[str, Any]:
    fields = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in _forced(tokens).items()}
    return {
        "data": {"model": workload.model, "stream": str(stream).lower(), **fields},
        "files": {"file": ("tone.wav", workload.wav, "audio/wav")},
    }


async def _whole(client: httpx.AsyncClient, workload: Workload, kind: str, tokens: int) -> bool:
    """A non-streamed request; True once its whole answer is checked."""
    if kind in ("chat", "media_chat", "video_chat"):
        response = await client.post("/v1/chat/completions", json=_chat_body(workload, kind, tokens))
        body = _json(response)
        _expect(body["choices"][0]["message"]["role"] == "assistant", "no assistant message", body)
        _expect_tokens(body["usage"]["completion_tokens"], tokens)
    elif kind == "completion":
        prompt = f"Count from {workload.rng.randint(0, 1000)}:"
        response = await client.post(
            "/v1/completions", json={"model": workload.model, "prompt": prompt, **_forced(tokens)}
        )
        body = _json(response)
        _expect(isinstance(body["choices"][0]["text"], str), "no text", body)
        _expect_tokens(body["usage"]["completion_tokens"], tokens)
    else:  # transcription
        response = await client.post("/v1/audio/transcriptions", **_form(workload, tokens, stream=False))
        _expect(isinstance(_json(response).get("text"), str), "no text", response.text)
    return True


async def _streamed(client: httpx.AsyncClient, workload: Workload, kind: str, tokens: int, cut: bool) -> bool:
    """A streamed request; True once the whole stream is checked, False if it was cut after one event."""
    usage_options = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat_stream":
        request = {
            "url": "/v1/chat/completions",
            "json": {**_chat_body(workload, kind, tokens), **usage_options},
        }
    elif kind == "completion_stream":
        body = {"model": workload.model, "prompt": "Once upon a time", **_forced(tokens), **usage_options}
        request = {"url": "/v1/completions", "json": body}
    else:
        request = {"url": "/v1/audio/transcriptions", **_form(workload, tokens, stream=True)}
    async with client.stream("POST", **request) as response:
        if response.status_code != 200:
            await response.aread()
            raise Lost(f"HTTP {response.status_code}: {response.text[:200]}")
        events = []
        async for event in _events(response):
            events.append(event)
            if cut:
                return False  # leaving the block closes the connection mid-stream
    _expect(events and events[-1] == "[DONE]", "the stream ended without [DONE]", events[-3:])
    payloads = [json.loads(e) for e in events[:-1]]
    errors = [p["error"] for p in payloads if "error" in p]
    _expect(not errors, "an error event", errors)
    if kind == "transcription_stream":
        done = [p for p in payloads if p.get("type") == "transcript.text.done"]
        _expect(len(done) == 1, "no transcript.text.done event", payloads[-2:])
        _expect_tokens(done[0]["usage"]["output_tokens"], tokens)
    else:
        usage = [p["usage"] for p in payloads if p.get("usage")]
        _expect(len(usage) == 1, "no usage chunk", payloads[-2:])
        _expect_tokens(usage[0]["completion_tokens"], tokens)
    return True


async def _events(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line.removeprefix("data:").strip()


def _json(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise Lost(f"HTTP {response.status_code}: {response.text[:200]}")
    try:
        return response.json()
    except ValueError:
        raise Lost(f"not JSON: {response.text[:200]}") from None


def _expect(condition: Any, what: str, seen: Any) -> None:
    if not condition:
        raise Lost(f"{what}: {str(seen)[:200]}")


def _expect_tokens(got: int, asked: int) -> None:
    _expect(got == asked, f"{got} tokens, {asked} were forced", got)


# -- the server's side ----------------------------------------------------------------------------------------


def metrics(client: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of /metrics by name, each summed over the replicas where replicas on Ray Serve
    answer (their samples labelled only by `replica`)."""
    text = client.get("/metrics").text
    sums: dict[str, float] = {}
    for m in re.finditer(r'^([a-z_]+)(?:\{replica="[^"]*"\})? ([0-9.e+-]+)$', text, re.MULTILINE):
        sums[m[1]] = sums.get(m[1], 0.0) + float(m[2])
    return sums


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from /proc (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024


PLATEAU_NOISE_MIB = 16  # what a second 1,000-request CPU soak grew a warm server by (issue 27)


class RssSampler:
    """The server's resident memory: /metrics' process_resident_memory_bytes where the server exports it,
    else /proc/<pid> for a server on this machine; `series` holds (requests done, bytes) samples."""

    def __init__(self, client: httpx.Client, pid: int | None) -> None:
        self.client, self.pid = client, pid
        self.source = "/metrics" if "process_resident_memory_bytes" in metrics(client) else None
        if self.source is None and pid:
            self.source = f"/proc/{pid}"
        self.series: list[tuple[int, int]] = []

    def read(self) -> int:
        if self.source == "/metrics":
            return int(metrics(self.client)["process_resident_memory_bytes"])
        return rss_bytes(self.pid)

    def sample(self, done: int) -> int:
        rss = self.read()
        self.series.append((done, rss))
        return rss


def plateau(series: list[tuple[int, float]]) -> tuple[float, float, str]:
    """Growth over the series' first half and over its second (split at its middle sample), and the verdict:
    "plateaus" when the second half grew at most PLATEAU_NOISE_MIB or at under half the first half's rate
    per request, else "still growing"; "too few samples" under three."""
    if len(series) < 3:
        return 0.0, 0.0, "too few samples"
    (n0, r0), (nm, rm), (n1, r1) = series[0], series[len(series) // 2], series[-1]
    early, late = rm - r0, r1 - rm
    growing = late > PLATEAU_NOISE_MIB and late / (n1 - nm) >= 0.5 * early / (nm - n0)
    return early, late, "still growing" if growing else "plateaus"


def settle(client: httpx.Client, timeout: float) -> tuple[dict[str, float], float]:
    """/metrics once no page is used and nothing runs or waits (or at the timeout), and the seconds it took."""
    start = time.monotonic()
    while True:
        m = metrics(client)
        busy = (
            m["omnistage_kv_pages_used"]
            + m["omnistage_num_requests_running"]
            + m["omnistage_num_requests_waiting"]
        )
        if busy == 0 or time.monotonic() - start > timeout:
            return m, time.monotonic() - start
        time.sleep(0.05)


# -- the run ----------------------------------------------------------------------------------------------------


async def run_requests(
    url: str,
    headers: dict[str, str],
    workload: Workload,
    kinds: list[str],
    concurrency: int,
    timeout: float,
    on_progress: Callable[[], None] = lambda: None,
) -> list[Outcome]:
    """Every request of `kinds`, at most `concurrency` at once; `on_progress` runs after each."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:

        async def gated(kind: str) -> Outcome:
            async with gate:
                outcome = await one_request(client, workload, kind)
                on_progress()
                return outcome

        return await asyncio.gather(*(gated(kind) for kind in kinds))


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.result] += 1
    counts = Counter(o.result for o in outcomes)
    ok = sorted(o.seconds for o in outcomes if o.result == "ok")
    return {
        "requests": len(outcomes),
        "ok": counts["ok"],
        "disconnected": counts["disconnected"],
        "lost": counts["lost"],
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "lost_reasons": [f"{o.kind}: {o.reason}" for o in outcomes if o.result == "lost"][:10],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(outcomes) / wall, 1),
        "latency_median_s": round(statistics.median(ok), 3) if ok else None,
        "latency_p99_s": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 3) if ok else None,
    }


def soak(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        rng = random.Random(args.seed)
        work = Workload(model, args.max_tokens, args.disconnect_share, rng)
        # A warm-up of each kind, whole, so that first-use allocations count in the baseline memory.
        warm = Workload(model, args.max_tokens, 0.0, random.Random(args.seed + 1))
        warmed = asyncio.run(run_requests(args.url, headers, warm, list(KINDS), 1, args.timeout))
        rss = RssSampler(client, args.pid)
        rss_start = rss.sample(0) if rss.source else None
        kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
        peak = rss_start or 0
        done = 0

        def sample_rss() -> None:
            nonlocal peak, done
            done += 1
            if args.pid:  # every request, where /proc is cheap to read
                peak = max(peak, rss_bytes(args.pid))
            # a blocking /metrics read in the clients' event loop, once per --rss-every requests
            if rss.source and done % args.rss_every == 0 and done < args.requests:
                peak = max(peak, rss.sample(done))

        start = time.perf_counter()
        outcomes = asyncio.run(
            run_requests(args.url, headers, work, kinds, args.concurrency, args.timeout, sample_rss)
        )
        wall = time.perf_counter() - start
        after, settle_s = settle(client, args.settle_s)
        rss_end = rss.sample(args.requests) if rss.source else None

    result = summarize(outcomes, wall)
    result["warmup_lost"] = [f"{o.kind}: {o.reason}" for o in warmed if o.result != "ok"]
    result["concurrency"] = args.concurrency
    result["kv_pages_used"] = int(after["omnistage_kv_pages_used"])
    result["kv_pages_total"] = int(after["omnistage_kv_pages_total"])
    result["running_after"] = int(after["omnistage_num_requests_running"])
    result["waiting_after"] = int(after["omnistage_num_requests_waiting"])
    result["settle_s"] = round(settle_s, 2)
    mib = 1024 * 1024
    if rss_start is not None and rss_end is not None:  # known for a server on this machine
        result["rss_start_mib"] = round(rss_start / mib, 1)
        result["rss_peak_mib"] = round(peak / mib, 1)
        result["rss_end_mib"] = round(rss_end / mib, 1)
        result["rss_growth_mib"] = round((rss_end - rss_start) / mib, 1)
        result["rss_source"] = rss.source
        result["rss_every"] = args.rss_every
        result["rss_series_mib"] = [[done, round(value / mib, 1)] for done, value in rss.series]
        early, late, verdict = plateau(result["rss_series_mib"])
        result["rss_first_half_growth_mib"] = round(early, 1)
        result["rss_second_half_growth_mib"] = round(late, 1)
        result["rss_verdict"] = verdict

    failures = []
    if result["lost"] or result["warmup_lost"]:
        failures.append(f"{result['lost'] + len(result['warmup_lost'])} requests lost")
    if result["kv_pages_used"] or result["running_after"] or result["waiting_after"]:
        failures.append(
            f"after {args.settle_s} s: {result['kv_pages_used']} KV pages used, {result['running_after']} "
            f"running, {result['waiting_after']} waiting"
        )
    if "rss_growth_mib" in result and result["rss_growth_mib"] > args.max_rss_growth_mib:
        failures.append(
            f"RSS grew {result['rss_growth_mib']} MiB, over the bound of {args.max_rss_growth_mib}"
        )
    if args.require_plateau and result.get("rss_verdict") == "still growing":
        failures.append(
            f"RSS still growing: {result['rss_second_half_growth_mib']} MiB over the run's second half"
        )
    result["failures"] = failures
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['requests']} requests at concurrency {result['concurrency']} in {result['wall_s']} s "
        f"({result['requests_per_s']} req/s): {result['ok']} ok, {result['disconnected']} disconnected on "
        f"purpose, {result['lost']} lost",
        f"latency of the whole ones: median {result['latency_median_s']} s, p99 {result['latency_p99_s']} s",
        "by kind: " + "; ".join(f"{k} {dict(v)}" for k, v in result["by_kind"].items()),
        f"after the run: {result['kv_pages_used']}/{result['kv_pages_total']} KV pages used "
        f"(settled in {result['settle_s']} s), {result['running_after']} running, "
        f"{result['waiting_after']} waiting",
    ]
    if "rss_growth_mib" in result:
        lines.append(
            f"server RSS: {result['rss_start_mib']} MiB after the warm-up, peak {result['rss_peak_mib']}, "
            f"end {result['rss_end_mib']} (growth {result['rss_growth_mib']} MiB)"
        )
        series = ", ".join(f"{done}: {mib}" for done, mib in result["rss_series_mib"])
        lines.append(
            f"server RSS every {result['rss_every']} requests (requests done: MiB, from {result['rss_source']}): "
            f"{series}; first half +{result['rss_first_half_growth_mib']} MiB, second half "
            f"+{result['rss_second_half_growth_mib']} MiB: {result['rss_verdict']}"
        )
    else:
        lines.append(
            "server RSS: not measured (its /metrics has no process_resident_memory_bytes: give --pid)"
        )
    lines += [f"lost: {reason}" for reason in result["lost_reasons"] + result["warmup_lost"]]
    lines.append("FAILED: " + "; ".join(result["failures"]) if result["failures"] else "PASSED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's base URL (default: start a tiny-model server)")
    p.add_argument("--pid", type=int,
                   help="the --url server's process id: its RSS from /proc where its /metrics has no "
                   "process_resident_memory_bytes, and the peak read after every request")  # fmt: skip
    p.add_argument("--api-key", help="the --url server's API key")
    p.add_argument("--model", help="checkpoint of the server it starts (default: the embedded tiny model)")
    p.add_argument("--server-args", default="--num-kv-pages 512",
                   help="more `omnistage serve` flags for the server it starts (default: %(default)s)")  # fmt: skip
    p.add_argument("--requests", type=int, default=1000, help="(default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--disconnect-share", type=float, default=0.1,
                   help="share of requests their client cuts off (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=8,
                   help="each request forces 1 to this many output tokens (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="(default: %(default)s)")
    p.add_argument("--rss-every", type=int, default=200,
                   help="sample the server's RSS every this many requests (default: %(default)s)")  # fmt: skip
    p.add_argument("--require-plateau", action="store_true",
                   help="fail when the RSS is still growing over the run's second half")  # fmt: skip
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="how long the KV pages may take to come back after the run (default: %(default)s)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    if args.rss_every < 1:
        p.error("--rss-every: at least 1")

    server = None
    if args.url is None:
        log = Path(tempfile.mkdtemp(prefix="omnistage-soak-")) / "server.log"
        model = ["--model", args.model] if args.model else []
        serve = ["--device", "cpu", "--log-level", "warning", *model, *args.server_args.split()]
        server = ServerProcess(serve, log).wait_ready(timeout=120)
        args.url, args.pid = server.url, server.process.pid
    try:
        result = soak(args)
    finally:
        if server is not None:
            server.stop()
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
