"""`omnistage bench a2t`: audio-to-text speed, as input-audio seconds per wall second (the real-time factor).

Every clip is transcribed once per pass (a concurrency above the number of clips cycles over the set
whole times, so that `c` requests are in flight), at most `c` requests in flight, for each concurrency of
the sweep; a pass reports the real-time factor (all clips' audio seconds / the pass's wall seconds) and the
TTFT and TPOT medians. Targets:

- a running server (`--url`): chat completions with `input_audio` (streamed; TTFT is the first chunk,
  which the server sends once the first token exists) or `/v1/audio/transcriptions` (streamed events); the
  body (the clip's base64, its JSON) is encoded before the clock starts;
- this process (`--model DIR`, or `--load-format dummy` for random weights at the released sizes): the
  engine behind an AsyncPipeline, from the preprocessing on; TTFT when the consumer gets the first token (as a
  client gets its first chunk), TPOT from each RequestOutput's metrics;
- `--baseline transformers` (in-process only): transformers' Thinker on the same weights and clips.

Random weights say nothing useful at the end of a sentence, so `--output-tokens N` forces every request
to exactly N tokens (max_tokens = min_tokens = N, ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.bench import builds
from omnistage.bench.clips import SYNTH_SETS, Clip, load_dir, synth_clips, total_seconds
from omnistage.bench.sse_client import StreamClient, error_message, sse_events
from omnistage.bench.stats import RequestTiming, summarize
from omnistage.bench.sweep import run as run_async
from omnistage.bench.sweep import sweep as generic_sweep

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("omnistage.bench")

DEFAULT_DUMMY_OUTPUT_TOKENS = 33  # the issue's reference point: a 5 s clip answered with 33 tokens
BASELINE_KV_GIB = 16.0  # our KV pool beside transformers, as benchmarks/thinker_decode.py leaves it

Runner = Callable[[Clip, int], Awaitable[RequestTiming]]  # (clip, request number) -> its timing


async def sweep(
    run: Runner, clips: list[Clip], concurrencies: list[int], warmup: int = 1, repeats: int = 1
) -> list[dict]:
    """`repeats` passes per concurrency, each over the clips as many whole times as c needs; each
    concurrency's summary (see summarize)."""
    return await generic_sweep(
        run, clips, concurrencies, summarize, count=lambda c: passes_for(c, len(clips)) * len(clips),
        warmup=warmup, repeats=repeats,
    )  # fmt: skip


def passes_for(concurrency: int, clips: int) -> int:
    """Whole times over the set one pass takes so that `concurrency` requests can be in flight."""
    return max(1, math.ceil(concurrency / clips))


# -- targets -----------------------------------------------------------------------------------------------


def forced(output_tokens: int | None, max_tokens: int) -> dict[str, Any]:
    """Sampling fields of a request: greedy, and exactly `output_tokens` when given."""
    if output_tokens:
        return {
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
    return {"max_tokens": max_tokens, "temperature": 0.0}


def server_runner(
    client: StreamClient | httpx.AsyncClient,
    model: str,
    endpoint: str,
    output_tokens: int | None,
    max_tokens: int,
) -> Runner:
    """Streamed requests to a running server through `client` (based at its URL); TTFT is the first chunk
    of a chat stream (the server sends it once the first token exists), the first delta of a transcription.

    A request's body is built before its clock starts (the clip's base64 and JSON, or the multipart form): the
    in-process runner builds none either. Its stages split the TTFT as the client saw it: upload (the clock's
    start to the request written), response (to the response's headers in), first_event (to the event that
    counts as the first token)."""
    import httpx

    from omnistage.models.qwen3_omni.transcription import INSTRUCTION

    fields = forced(output_tokens, max_tokens)

    async def timed(
        clip: Clip, path: str, body: bytes, headers: dict[str, str], first_token: str
    ) -> RequestTiming:
        stamps: dict[str, float] = {}
        start = time.perf_counter()
        first, tokens, deltas = None, 0, 0
        async for event in events(client, path, body, headers, stamps):
            if first_token in ("", event.get("type")):
                first = first or time.perf_counter()
                deltas += 1
            usage = event.get("usage") or {}
            tokens = usage.get("completion_tokens") or usage.get("output_tokens") or tokens
        end = stamps.get("done") or time.perf_counter()
        sent, headers_in = stamps.get("sent"), stamps.get("headers")
        stages = {}
        if sent is not None and headers_in is not None and first is not None:
            stages = {
                "upload": sent - start,
                "response": headers_in - sent,
                "first_event": first - headers_in,
            }
        return RequestTiming(clip.seconds, (first or end) - start, end - start, tokens or deltas, stages)

    async def chat(clip: Clip, number: int) -> RequestTiming:
        audio = {"data": base64.b64encode(clip.wav_bytes()).decode(), "format": "wav"}
        content = [{"type": "input_audio", "input_audio": audio}, {"type": "text", "text": INSTRUCTION}]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "stream_options": {"include_usage": True},
            **fields,
        }
        return await timed(
            clip, "/v1/chat/completions", json.dumps(body).encode(), JSON_HEADERS, first_token=""
        )

    async def transcribe(clip: Clip, number: int) -> RequestTiming:
        form = {"model": model, "stream": "true", **{k: _form_value(v) for k, v in fields.items()}}
        files = {"file": (f"{clip.name}.wav", clip.wav_bytes(), "audio/wav")}
        request = httpx.Request("POST", "http://server/", data=form, files=files)
        headers = {"content-type": request.headers["content-type"]}
        return await timed(clip, "/v1/audio/transcriptions", request.read(), headers, "transcript.text.delta")

    return chat if endpoint == "chat" else transcribe


async def events(
    client: StreamClient | httpx.AsyncClient,
    path: str,
    body: bytes,
    headers: dict[str, str],
    stamps: dict[str, float],
) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a POST's server-sent events up to `[DONE]`, each as soon as it arrives; `stamps` as
    StreamClient.events fills it (httpx's from httpcore's trace events).

    A refused request (HTTP status other than 200) or an error event in the stream raises RuntimeError with
    the server's message.
    """
    if isinstance(client, StreamClient):
        async for event in client.events(path, body, headers, stamps):
            yield event
        return

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event in _HTTPCORE_STAMPS:
            stamps[_HTTPCORE_STAMPS[event]] = time.perf_counter()

    request: dict[str, Any] = {"content": body, "headers": headers, "extensions": {"trace": trace}}
    async with client.stream("POST", path, **request) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {error_message(response.text)}")
        async for event in sse_events(path, response.aiter_bytes(), stamps):
            yield event


JSON_HEADERS = {"content-type": "application/json"}
_HTTPCORE_STAMPS = {
    "http11.send_request_body.complete": "sent",
    "http11.receive_response_headers.complete": "headers",
}


def _form_value(value: float | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def inprocess_runner(engine: Any, output_tokens: int | None, max_tokens: int) -> Runner:
    """Requests straight into an AsyncPipeline, prompts laid out by its processor as the server does."""
    from omnistage.request import GenerationRequest, SamplingParams

    params = SamplingParams(**forced(output_tokens, max_tokens))
    processor = engine.frontend.processor

    async def run(clip: Clip, number: int) -> RequestTiming:
        start = time.perf_counter()
        prompt = await asyncio.to_thread(processor.transcription, clip.audio, None, None)
        prepared = time.perf_counter() - start
        submitted = time.monotonic()
        final, received = None, None
        request = GenerationRequest(
            f"a2t-{number}", prompt.token_ids, params, prompt.prompt, prompt.mrope, prompt.mm
        )
        async for output in engine.generate(request):
            # the first token as this consumer gets it, as a client over HTTP gets its first chunk
            received = received or (time.monotonic() if output.outputs[0].token_ids else None)
            final = output
        if final is None or final.outputs[0].finish_reason in ("error", "abort"):
            raise RuntimeError(f"{clip.name}: the engine failed it: {final and final.error}")
        m = final.metrics
        received = received or m["first_token"]
        stages = {
            "preprocess": prepared,
            "to_engine": m["arrival"] - submitted,
            "encode": m["encoded"] - m["arrival"],
            "queue": m["scheduled"] - m["encoded"],
            "prefill": m["first_token"] - m["scheduled"],
            "delivery": received - m["first_token"],  # the engine's thread to this consumer
        }
        return RequestTiming(
            clip.seconds,
            received - submitted + prepared,
            m["finished"] - submitted + prepared,
            len(final.outputs[0].token_ids),
            stages,
        )

    return run


# -- the command ---------------------------------------------------------------------------------------------


def load_clips(args: argparse.Namespace) -> list[Clip]:
    if args.clips:
        clips = load_dir(args.clips)
    else:
        durations = SYNTH_SETS[args.synth or "librispeech"]
        clips = synth_clips(durations, seed=args.seed, espeak=None if args.espeak else False)
    if args.limit:
        clips = clips[: args.limit]
    log.info("%d clips, %.1f s of audio", len(clips), total_seconds(clips))
    return clips


# --load-format dummy: which released model's sizes (the configs packaged in omnistage/data)
SKELETONS = {
    "qwen3-omni": None,
    "qwen3-asr-1.7b": "qwen3_asr_1p7b.config.json",
    "qwen3-asr-0.6b": "qwen3_asr_0p6b.config.json",
}


def released_skeleton(name: str = "qwen3-omni") -> Path:
    """A checkpoint directory at a released model's sizes with no weights, for `--load-format dummy`."""
    directory = Path(tempfile.mkdtemp(prefix="omnistage-released-"))
    skeleton = SKELETONS[name]
    if skeleton is not None:
        from omnistage.models.qwen3_asr.tiny import released_skeleton as asr_skeleton

        return asr_skeleton(directory, skeleton)
    from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG, released_config
    from omnistage.models.qwen3_omni.tokenizer import write_tokenizer_files

    (directory / "config.json").write_text(json.dumps(released_config()))
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    write_tokenizer_files(directory)
    return directory


def run_a2t(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark as `omnistage bench a2t` runs it; returns what it writes as JSON."""
    clips = load_clips(args)
    concurrencies = [int(c) for c in str(args.concurrency).split(",")]
    output_tokens = args.output_tokens
    results: dict[str, Any] = {
        "clips": [{"name": c.name, "seconds": round(c.seconds, 3)} for c in clips],
        "audio_s": round(total_seconds(clips), 3),
        "output_tokens": output_tokens,
    }
    if args.url:
        model = args.served_model or _first_model(args.url, args.api_key)
        results["target"] = {
            "url": args.url,
            "model": model,
            "endpoint": args.endpoint,
            "client": args.http_client,
        }
        before = builds.on_server(args.url)
        results["ours"] = run_async(_over_http(args, model, clips, concurrencies, output_tokens))
        results["builds_while_serving"] = builds.on_server(args.url) - before
        return results

    from omnistage.config import engine_config
    from omnistage.pipeline.async_pipeline import AsyncPipeline
    from omnistage.pipeline.family import build_pipeline

    model_dir = args.model or (str(released_skeleton(args.skeleton)) if args.load_format == "dummy" else None)
    if output_tokens is None and args.load_format == "dummy":
        output_tokens = results["output_tokens"] = DEFAULT_DUMMY_OUTPUT_TOKENS
    overrides = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": max(concurrencies),
        # On a GPU our KV pool takes all the memory left unless told otherwise; transformers needs some.
        "kv_cache_memory_gib": args.kv_cache_memory_gib or (BASELINE_KV_GIB if args.baseline else None),
        "enforce_eager": args.enforce_eager or None,
        "max_prefill_graph_tokens": args.max_prefill_graph_tokens,
    }
    config = engine_config(
        "bench a2t",
        model=model_dir,
        load_format=args.load_format,
        speech=False,  # text out: a Talker's weights and pages stay off the GPU
        **{k: v for k, v in overrides.items() if v is not None},
    )
    started = time.perf_counter()
    pipeline = build_pipeline(config)
    engine = AsyncPipeline(pipeline)
    results["engine_start_s"] = round(time.perf_counter() - started, 2)
    results["target"] = {"model": str(engine.frontend.model_path), "load_format": args.load_format}
    results["engine"] = engine.memory_summary()
    try:
        run = inprocess_runner(engine, output_tokens, args.max_tokens)
        results["ours"] = run_async(sweep(run, clips, concurrencies, args.warmup, args.repeats))
        results["builds_while_serving"] = builds.in_process()
        if args.baseline == "transformers":
            results["transformers"] = _transformers(
                pipeline.thinker, clips, output_tokens, args.max_tokens, args.repeats
            )
    finally:
        engine.shutdown()
    return results


def _transformers(
    llm_engine: Any, clips: list[Clip], output_tokens: int | None, max_tokens: int, repeats: int
) -> dict:
    from omnistage.bench.hf_baseline import build_hf_thinker, run_hf
    from omnistage.models.qwen3_omni.transcription import transcription_messages

    config_dict = json.loads((Path(llm_engine.model_path) / "config.json").read_text())
    if config_dict.get("model_type") == "qwen3_asr":
        from omnistage.bench.hf_asr import build_hf_asr, run_hf_asr

        hf = build_hf_asr(llm_engine, config_dict)
        summary = run_hf_asr(
            hf, llm_engine.processor, clips, output_tokens, max_tokens, llm_engine.device, repeats
        )
        summary["towers"] = {"audio_tower": "shared with ours"}
        return summary
    hf, sources = build_hf_thinker(llm_engine, config_dict)
    summary = run_hf(
        hf,
        llm_engine.processor,
        clips,
        lambda clip: transcription_messages(clip.audio, None, None),
        output_tokens,
        max_tokens,
        llm_engine.device,
        repeats,
    )
    summary["towers"] = sources
    return summary


async def _over_http(
    args: argparse.Namespace,
    model: str,
    clips: list[Clip],
    concurrencies: list[int],
    output_tokens: int | None,
) -> list[dict]:
    import httpx

    url = args.url.rstrip("/")
    if args.http_client == "h11":
        client = StreamClient(url, _auth(args.api_key))
        try:
            run = server_runner(client, model, args.endpoint, output_tokens, args.max_tokens)
            return await sweep(run, clips, concurrencies, args.warmup, args.repeats)
        finally:
            client.close()
    # A connection per request in flight: a smaller pool would queue requests here and count it as latency.
    most = max(concurrencies)
    async with httpx.AsyncClient(
        base_url=url,
        headers=_auth(args.api_key),
        timeout=httpx.Timeout(600.0, connect=10.0),
        limits=httpx.Limits(max_connections=most, max_keepalive_connections=most),
    ) as httpx_client:
        run = server_runner(httpx_client, model, args.endpoint, output_tokens, args.max_tokens)
        return await sweep(run, clips, concurrencies, args.warmup, args.repeats)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _first_model(url: str, api_key: str | None) -> str:
    import httpx

    response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=_auth(api_key), timeout=10)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/models: HTTP {response.status_code}: {error_message(response.text)}")
    return response.json()["data"][0]["id"]


def report(results: dict[str, Any]) -> str:
    """A markdown table of every pass, ours and (when run) transformers' at c=1."""
    lines = [
        f"{len(results['clips'])} clips, {results['audio_s']:.1f} s of audio, "
        f"output tokens {results['output_tokens'] or 'natural'}",
        "",
        "| target | c | RTF (x real time) | TTFT median ms | TPOT median ms | wall s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("ours", "transformers"):
        passes = results.get(name)
        for p in [passes] if isinstance(passes, dict) else passes or []:
            lines.append(
                f"| {name} | {p['concurrency']} | {p['rtf']:.2f} | {p['ttft_median_ms']:.1f} | "
                f"{p['tpot_median_ms']:.2f} | {p['wall_s']:.2f} |"
            )
    for p in results.get("ours") or []:
        if "stages_median_ms" in p:
            stages = ", ".join(f"{k} {v:.1f}" for k, v in p["stages_median_ms"].items())
            lines.append(f"\nours, c={p['concurrency']}, to the first token (median ms): {stages}")
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """NaN (a one-token TPOT, a missing TTFT) as null, which every JSON reader accepts."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(args: argparse.Namespace) -> None:
    if args.baseline and args.url:
        raise SystemExit("omnistage bench a2t: --baseline runs in-process; drop --url")
    results = run_a2t(args)
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps(_json_safe(results), indent=2) + "\n")
        log.info("wrote %s", args.out)
    builds.check(args, results.get("builds_while_serving", []))


def add_parser(sub: Any) -> None:
    """`omnistage bench a2t ...` under the `bench` subcommand's subparsers."""
    p = sub.add_parser("a2t", help="audio-to-text speed: real-time factor, TTFT, TPOT", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    clips = p.add_mutually_exclusive_group()
    clips.add_argument(
        "--clips", help="a directory of .wav/.flac clips (a same-named .txt is its transcript)"
    )
    clips.add_argument("--synth", choices=sorted(SYNTH_SETS),
                       help="synthesise clips with these durations (default: librispeech, 20 clips, 94 s; "
                            "5s: one 5 s clip)")  # fmt: skip
    p.add_argument("--no-espeak", dest="espeak", action="store_false",
                   help="synthesise speech-like signals even where espeak-ng is installed")  # fmt: skip
    p.add_argument("--limit", type=int, help="use only the first N clips")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesised clips (default: %(default)s)")
    target = p.add_argument_group("target")
    target.add_argument("--url", help="a running server's base URL (http://host:port); else in-process")
    target.add_argument(
        "--endpoint",
        choices=["chat", "transcriptions"],
        default="chat",
        help="with --url (default: %(default)s)",
    )
    target.add_argument("--served-model", help="the model name the server serves (default: its first)")
    target.add_argument("--api-key", help="with --url: the server's API key (default: none)")
    target.add_argument(
        "--http-client",
        choices=["h11", "httpx"],
        default="h11",
        help="with --url: h11, a thin client on asyncio streams (omnistage/bench/sse_client.py), or httpx "
        "(its layers added ~2 ms to a lone request's first token on the H200's host) (default: %(default)s)",
    )
    target.add_argument(
        "--model", help="in-process: checkpoint directory (default: released sizes when dummy)"
    )
    target.add_argument(
        "--skeleton",
        choices=list(SKELETONS),
        default="qwen3-omni",
        help="with --load-format dummy and no --model: the released sizes of (default: %(default)s)",
    )
    target.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="in-process (default: %(default)s)",
    )
    target.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="in-process (default: the engine's, auto)"
    )
    target.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="in-process (default: the engine's, auto)",
    )
    target.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        help=f"in-process (default: the engine's; {BASELINE_KV_GIB:g} with --baseline)",
    )
    target.add_argument("--enforce-eager", action="store_true")
    target.add_argument("--max-prefill-graph-tokens", type=int,
                        help="largest prefill chunk captured in a CUDA graph (0: none; default: the engine's)")  # fmt: skip
    target.add_argument(
        "--baseline", choices=["transformers"], help="also time transformers on the same weights"
    )
    p.add_argument(
        "--concurrency", default="1", help="one concurrency or a sweep, e.g. 1,4,16 (default: %(default)s)"
    )
    p.add_argument("--output-tokens", type=int,
                   help=f"force exactly N output tokens (default with dummy weights: {DEFAULT_DUMMY_OUTPUT_TOKENS})")  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=256, help="cap on natural (unforced) outputs (default: %(default)s)"
    )
    p.add_argument("--warmup", type=int, default=1, help="requests run before timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes per concurrency (and for the baseline); figures are their medians (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", help="write the results as JSON here")
    builds.add_argument(p)
    p.set_defaults(func=main)
