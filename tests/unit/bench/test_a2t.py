"""The a2t harness: the sweep's arithmetic on a fake target, the command line, and a tiny in-process run."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import uvicorn

from omnistage.bench import a2t, a2t_targets, sse_client
from omnistage.bench.baseline import BASELINE_KV_GIB, kv_beside_baseline
from omnistage.bench.clips import Clip
from omnistage.bench.skeletons import released_skeleton
from omnistage.bench.stats import RequestTiming, json_safe
from omnistage.cli import bind, build_parser
from omnistage.config import engine_config
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app


def clip(seconds: float, name: str = "c") -> Clip:
    return Clip(name, np.zeros(round(seconds * 16000), dtype=np.float32))


def test_sweep_runs_every_clip_per_pass_within_its_concurrency():
    clips = [clip(s, f"c{i}") for i, s in enumerate([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]
    in_flight, peak, seen = 0, {}, []

    async def run(c: Clip, number: int) -> RequestTiming:
        nonlocal in_flight
        in_flight += 1
        peak[current] = max(peak.get(current, 0), in_flight)
        seen.append(number)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return RequestTiming(c.seconds, 0.01, 0.02, 3)

    current = "warmup"

    async def main():
        nonlocal current
        results = []
        for c in (1, 3):
            current = c
            results += await a2t.sweep(run, clips, [c], warmup=1 if c == 1 else 0)
        return results

    one, three = asyncio.run(main())
    repeated = asyncio.run(a2t.sweep(run, clips[:2], [2], warmup=0, repeats=3))[0]
    assert repeated["passes"] == 3 and repeated["requests"] == 2 and len(repeated["rtf_per_pass"]) == 3
    assert 0.02 <= repeated["wall_s"] < 0.2 and sorted(seen[-6:]) == list(range(6))  # unique request numbers
    assert peak[1] == 1 and peak[3] == 3
    assert seen[0] == -1 and sorted(seen[1:7]) == list(range(6))  # the warm-up, then one pass
    assert one["requests"] == 6 and one["audio_s"] == 21.0
    assert one["rtf"] == pytest.approx(21.0 / one["wall_s"], rel=1e-2)
    assert 0.12 <= one["wall_s"] < 0.5  # six 20 ms requests one after another
    assert three["wall_s"] < one["wall_s"]  # two waves of three
    assert one["ttft_median_ms"] == 10.0 and one["tpot_median_ms"] == 5.0


def test_a_concurrency_above_the_set_cycles_over_it_whole_times():
    clips = [clip(s, f"c{i}") for i, s in enumerate([1.0, 2.0, 3.0])]
    in_flight = peak = 0

    async def run(c: Clip, number: int) -> RequestTiming:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return RequestTiming(c.seconds, 0.01, 0.02, 3)

    (seven,) = asyncio.run(a2t.sweep(run, clips, [7], warmup=0))
    assert a2t.passes_for(7, 3) == 3 and a2t.passes_for(2, 3) == 1
    assert seven["requests"] == 9 and seven["audio_s"] == 18.0 and peak == 7


def test_rounds_keep_c_in_flight_for_several_times_c_requests():
    clips = [clip(s, f"c{i}") for i, s in enumerate([1.0, 2.0, 3.0])]
    in_flight = peak = 0
    started: list[float] = []

    async def run(c: Clip, number: int) -> RequestTiming:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        started.append(time.perf_counter())
        await asyncio.sleep(0.02 * c.seconds)  # unequal lengths: a slot frees before the others
        in_flight -= 1
        return RequestTiming(c.seconds, 0.01, 0.02, 3)

    (burst,) = asyncio.run(a2t.sweep(run, clips, [2], warmup=0))
    assert burst["requests"] == 3
    started.clear()
    (steady,) = asyncio.run(a2t.sweep(run, clips, [2], warmup=0, rounds=4))
    assert steady["requests"] == 9 and steady["audio_s"] == 18.0 and peak == 2  # 4·2 = 8 → three times over
    assert started[2] - started[0] == pytest.approx(0.02, abs=0.015)  # the shortest clip's slot taken at once


def test_forced_lengths():
    assert a2t_targets.forced(33, 256) == {
        "max_tokens": 33,
        "min_tokens": 33,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    assert a2t_targets.forced(None, 256) == {"max_tokens": 256, "temperature": 0.0}


def test_report_and_json_safety():
    passes = [
        {"concurrency": 1, "rtf": 20.5, "ttft_median_ms": 70.0, "tpot_median_ms": math.nan, "wall_s": 4.6}
    ]
    results = {
        "clips": [{}] * 20,
        "audio_s": 94.0,
        "output_tokens": 33,
        "ours": passes,
        "transformers": passes[0],
    }
    table = a2t.report(results)
    assert "20 clips, 94.0 s of audio, output tokens 33" in table
    assert "| ours | 1 | 20.50 | 70.0 | nan | 4.60 |" in table
    assert "| transformers | 1 | 20.50 |" in table
    assert json.loads(json.dumps(json_safe(results)))["ours"][0]["tpot_median_ms"] is None


def test_command_line():
    args = build_parser().parse_args(["bench", "a2t", "--load-format", "dummy", "--concurrency", "1,4,16"])
    assert (
        args.func is a2t.main and args.synth is None and args.clips is None and args.concurrency == "1,4,16"
    )
    assert args.output_tokens is None and args.url is None and args.espeak is True and args.repeats == 3
    args = build_parser().parse_args(["bench", "a2t", "--url", "http://h:1", "--endpoint", "transcriptions"])
    assert (args.url, args.endpoint) == ("http://h:1", "transcriptions")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "a2t", "--clips", "d", "--synth", "librispeech"])


def test_released_skeleton_has_what_the_processor_needs():
    directory = released_skeleton()
    config = json.loads((directory / "config.json").read_text())
    assert config["thinker_config"]["text_config"]["num_hidden_layers"] == 48
    assert Processor(directory).encode("hello")


def test_in_process_smoke_with_the_transformers_baseline(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "a2t.json"
    args = build_parser().parse_args(
        ["bench", "a2t", "--model", str(tiny_checkpoint), "--device", "cpu", "--limit", "3", "--no-espeak",
         "--concurrency", "1,2", "--output-tokens", "5", "--baseline", "transformers", "--repeats", "2",
         "--out", str(out)]
    )  # fmt: skip
    args.func(args)
    results = json.loads(out.read_text())
    assert results["audio_s"] == pytest.approx(1.9 + 2.3 + 2.6)
    ours = results["ours"]
    assert [p["concurrency"] for p in ours] == [1, 2]
    for p in [*ours, results["transformers"]]:
        assert p["requests"] == 3 and p["passes"] == 2 and p["output_tokens"] == 15
        assert p["rtf"] > 0 and p["ttft_median_ms"] > 0 and p["tpot_median_ms"] > 0
    # the stages before the first token add up to it, request by request; their medians over 6 requests on a
    # busy CPU only roughly (the queue stage varies most at c=2)
    for p in ours:
        stages = p["stages_median_ms"]
        assert set(stages) == {"preprocess", "to_engine", "encode", "queue", "prefill", "delivery"}
        assert all(v >= 0 for v in stages.values()) and stages["encode"] > 0 and stages["prefill"] > 0
        assert sum(stages.values()) == pytest.approx(p["ttft_median_ms"], rel=0.5)
    # every request sent its clip as its own (a warm-up and 12 timed requests over 3 clips): the audio tower's
    # cache and the prefix cache served none of them
    served = results["caches_served"]
    assert served["encoder_cache_misses"] == 13 and served["encoder_cache_hits"] == 0
    assert served["prefix_cache_queries"] > 0 and served["prefix_cache_hits"] == 0
    assert results["transformers"]["towers"] == {
        "audio_tower": "shared with ours",
        "visual": "shared with ours",
    }
    printed = capsys.readouterr().out
    assert (
        "| transformers | 1 |" in printed
        and "ours, c=2, to the first token (median ms): preprocess" in printed
    )


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint) -> Iterator[str]:
    """The real app on the tiny checkpoint, served by uvicorn on a thread of this process."""
    engine = AsyncPipeline.from_config(
        engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=64)
    )
    listener = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", api_key="k"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()
    listener.close()


def over_http(url: str, *extra: str) -> dict:
    args = build_parser().parse_args(
        ["bench", "a2t", "--url", url, "--api-key", "k", "--limit", "2", "--no-espeak", "--output-tokens", "4",
         "--warmup", "0", "--repeats", "1", *extra]
    )  # fmt: skip
    return a2t.run_a2t(args)


@pytest.mark.parametrize("http_client", ["h11", "httpx"])
@pytest.mark.parametrize("endpoint", ["chat", "transcriptions"])
def test_over_http_with_the_runtime_dependencies_only(server_url, endpoint, http_client, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # a plain `pip install omnistage` has no openai
    opened = []
    connect = sse_client._Connection.open

    async def counted(*args):
        opened.append(args)
        return await connect(*args)

    monkeypatch.setattr(sse_client._Connection, "open", counted)
    results = over_http(
        server_url, "--endpoint", endpoint, "--concurrency", "1,2", "--http-client", http_client
    )
    assert results["target"] == {
        "url": server_url,
        "model": "tiny",
        "endpoint": endpoint,
        "client": http_client,
    }
    for p in results["ours"]:
        assert p["requests"] == 2 and p["output_tokens"] == 8  # from the streams' usage
        assert 0 < p["ttft_median_ms"] < p["latency_median_ms"] and p["tpot_median_ms"] > 0
        # the client's split of the TTFT: upload, the server's answer, the first event
        stages = p["stages_mean_ms"]
        assert set(stages) == {"upload", "response", "first_event"} and all(v >= 0 for v in stages.values())
        assert (
            stages["response"] > stages["upload"]
        )  # the answer waits for a token; the upload is a local write
        assert sum(stages.values()) == pytest.approx(p["ttft_median_ms"], rel=0.5)
    # h11: a connection per request in flight, kept alive from one request to the next (4 requests, 2 at most)
    # the server's /metrics over the run: each request's clip its own, encoded, though the server saw this test's
    # other runs (the same clips, other numbers)
    served = results["caches_served"]
    assert served["encoder_cache_misses"] == sum(p["requests"] for p in results["ours"])
    assert served["encoder_cache_hits"] == 0
    assert served["prefix_cache_queries"] > 0 and served["prefix_cache_hits"] == 0
    assert len(opened) == (2 if http_client == "h11" else 0)


@pytest.mark.parametrize("http_client", ["h11", "httpx"])
@pytest.mark.parametrize("endpoint", ["chat", "transcriptions"])
def test_over_http_a_refused_request_stops_the_run_with_the_servers_message(
    server_url, endpoint, http_client
):
    with pytest.raises(RuntimeError, match="HTTP 404.*the model 'nope' does not exist"):
        over_http(
            server_url,
            "--endpoint",
            endpoint,
            "--served-model",
            "nope",
            "--limit",
            "1",
            "--http-client",
            http_client,
        )


def test_only_a_gpu_engine_beside_transformers_gets_the_fixed_kv_pool():
    assert kv_beside_baseline(None, True, "cpu") is None
    assert kv_beside_baseline(2.5, True, "cpu") == 2.5
    assert kv_beside_baseline(None, False, "cpu") is None
    if torch.cuda.is_available():
        assert kv_beside_baseline(None, True, "cuda") == BASELINE_KV_GIB
        assert kv_beside_baseline(None, False, "cuda") is None


@pytest.mark.parametrize("skeleton,layers", [("qwen3-asr-0.6b", 18), ("qwen3-asr-1.7b", 24)])
def test_asr_skeletons_carry_the_released_sizes(skeleton, layers):
    from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
    from omnistage.models.qwen3_asr.processor import ASRProcessor

    directory = released_skeleton(skeleton)
    assert Qwen3ASRConfig.from_dir(directory).audio.encoder_layers == layers
    assert ASRProcessor(directory).encode("hello")


def test_qwen3_asr_in_process_with_the_transformers_baseline(tmp_path):
    """The same harness on a Qwen3-ASR checkpoint: its prompts, its engine, transformers' Qwen3-ASR sharing its
    weights (the parameters are our tensors)."""
    from omnistage.bench.hf_asr import build_hf_asr
    from omnistage.models.qwen3_asr.tiny import make_tiny
    from omnistage.pipeline.family import build_pipeline

    checkpoint = make_tiny(tmp_path / "asr")
    out = tmp_path / "a2t.json"
    args = build_parser().parse_args(
        ["bench", "a2t", "--model", str(checkpoint), "--device", "cpu", "--limit", "2", "--no-espeak",
         "--concurrency", "1,2", "--output-tokens", "4", "--baseline", "transformers", "--out", str(out)]
    )  # fmt: skip
    args.func(args)
    results = json.loads(out.read_text())
    for p in [*results["ours"], results["transformers"]]:
        assert p["requests"] == 2 and p["output_tokens"] == 8 and p["rtf"] > 0
    assert "Qwen3-ASR" in results["engine"]
    kv_gib = float(re.search(r"= ([0-9.]+) GiB \(", results["engine"]).group(1))
    assert kv_gib < BASELINE_KV_GIB  # the CPU engine's own pool, not the one sized to sit beside it on a GPU
    stage = build_pipeline(engine_config(model=str(checkpoint), device="cpu", num_kv_pages=16)).thinker
    hf = build_hf_asr(stage, json.loads((checkpoint / "config.json").read_text()))
    ours = {p.data_ptr() for p in [*stage.model.parameters(), *stage.encoders.audio_encoder.parameters()]}
    assert all(p.data_ptr() in ours for p in hf.parameters())


def test_qwen3_asr_with_the_engine_in_a_process_of_its_own(tmp_path):
    """`--engine-process`: the engine steps in a second process (this one prepares) and serves every request
    to its forced length; its builds are counted on its side, and the flag refuses a remote target."""
    from omnistage.models.qwen3_asr.tiny import make_tiny

    checkpoint = make_tiny(tmp_path / "asr")
    out = tmp_path / "a2t.json"
    args = build_parser().parse_args(
        ["bench", "a2t", "--model", str(checkpoint), "--device", "cpu", "--limit", "3", "--no-espeak",
         "--concurrency", "3", "--rounds", "2", "--output-tokens", "4", "--repeats", "1", "--engine-process",
         "--out", str(out)]
    )  # fmt: skip
    args.func(args)
    results = json.loads(out.read_text())
    (ours,) = results["ours"]
    assert results["engine_process"] is True
    assert ours["requests"] == 6 and ours["output_tokens"] == 24 and ours["rtf"] > 0
    assert "Qwen3-ASR" in results["engine"] and results["builds_while_serving"] == 0
    remote = build_parser().parse_args(["bench", "a2t", "--url", "http://127.0.0.1:1", "--engine-process"])
    with pytest.raises(SystemExit, match="--engine-process is in-process"):
        remote.func(remote)


def test_counting_requests_being_prepared_holds_an_idle_engines_burst_for_its_last(tmp_path, monkeypatch):
    """`--count-preparing`: each request counts as being prepared until it goes in, as the server counts those it
    reads, so an idle engine admits a burst whole (one encoder pass, one prompt step) once its last arrives."""
    from omnistage.models.qwen3_asr.tiny import make_tiny
    from omnistage.pipeline.step_loop import StepLoop

    admitted: list[int] = []
    admit = StepLoop._admit

    def counted(self, requests):
        admitted.append(len(requests))
        return admit(self, requests)

    monkeypatch.setattr(StepLoop, "_admit", counted)
    checkpoint = make_tiny(tmp_path / "asr")
    out = tmp_path / "a2t.json"
    args = build_parser().parse_args(
        ["bench", "a2t", "--model", str(checkpoint), "--device", "cpu", "--limit", "4", "--no-espeak",
         "--concurrency", "4", "--output-tokens", "3", "--repeats", "1", "--count-preparing",
         "--admission-window-ms", "60000", "--out", str(out)]
    )  # fmt: skip
    args.func(args)
    results = json.loads(out.read_text())
    (ours,) = results["ours"]
    assert results["count_preparing"] is True
    assert ours["requests"] == 4 and ours["output_tokens"] == 12
    assert admitted == [1, 4]  # the warm-up request alone, then the burst of four together
