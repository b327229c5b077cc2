"""Prometheus metrics of one server, in its own registry (two apps in one process never collide), with the
process_* gauges of its process (resident memory, CPU seconds, open files).

Request counters and latency histograms are fed as requests end; the pipeline's gauges (queue, KV pages) are
read from its stats at scrape time, so they are never stale. The memory plan of each device is fixed at start:
its gauges are set once, from the Frontend (`set_plan`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from omnistage.outputs import RequestOutput
from omnistage.pipeline.base import Frontend

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_PHASES_HELP = (
    "Where a request's time to first token goes: receive (headers in to the whole body in), prepare "
    "(body received to handed over: parsing, media decoding, the prompt's layout), parse (prepare's "
    "first part: the body's JSON or form parsed and validated), to_engine (handed over to admitted), "
    "first_token (admitted to first token: encoders, queue, prefill), delivery (first token to the "
    "request's handler; streamed responses only), respond (a stream's first output in its handler to its "
    "first chunk written)"
)
_REALTIME_PHASES_HELP = (
    "Where a spoken realtime turn's time from the end of the user's speech to its first audio delta goes: "
    "lay_out (the conversation rendered, its audio featurised), to_engine (handed over to admitted), encode "
    "(the audio tower), queue (encoded to first scheduled), prefill (to the first text token), speak (to the "
    "first audio chunk: Talker, code predictor, Code2Wav), send (the chunk encoded and sent)"
)
# The marks of a realtime turn, in order, each phase named by the mark that ends it (realtime_turn)
_REALTIME_MARKS = (
    ("submitted", "lay_out"),
    ("arrival", "to_engine"),
    ("encoded", "encode"),
    ("scheduled", "queue"),
    ("first_token", "prefill"),
    ("first_audio", "speak"),
    ("sent", "send"),
)
# The gauges read from the pipeline's stats at scrape time, by stat: a stat the pipeline does not report (the
# Talker's where it does not speak, the allocator's on a CPU) leaves its gauge at 0.
_STAT_GAUGES = {
    "num_waiting": ("omnistage_num_requests_waiting", "Requests queued for the engine"),
    "num_running": ("omnistage_num_requests_running", "Requests the engine is running"),
    "kv_pages_total": ("omnistage_kv_pages_total", "KV cache pages in the pool"),
    "kv_pages_used": ("omnistage_kv_pages_used", "KV cache pages held by requests"),
    "kv_pages_free": ("omnistage_kv_pages_free", "KV cache pages free (never used, or cached and evictable)"),
    "kv_pages_cached": (
        "omnistage_kv_pages_cached",
        "KV cache pages holding a cached prompt prefix, held by requests or evictable",
    ),
    "talker_kv_pages_total": ("omnistage_talker_kv_pages_total", "The Talker's KV cache pages (speech out)"),
    "talker_kv_pages_free": ("omnistage_talker_kv_pages_free", "The Talker's KV pages free"),
    "num_speaking": ("omnistage_num_requests_speaking", "Requests whose reply is being spoken"),
    "encoder_rows_held_bytes": (
        "omnistage_encoder_rows_held_bytes",
        "Device memory holding encoder rows of requests whose prefill has not passed them (at most "
        "--encoder-rows-mib or the largest media request's)",
    ),
    "encoder_cache_bytes": (
        "omnistage_encoder_cache_bytes",
        "Host memory holding the audio tower's rows of clips kept for later requests",
    ),
    "gpu_memory_reserved_bytes": (
        "omnistage_gpu_memory_reserved_bytes",
        "GPU memory the caching allocator holds",
    ),
    "gpu_alloc_retries": (
        "omnistage_gpu_alloc_retries",
        "Allocations that found the GPU full and retried after freeing the allocator's cache",
    ),
    "builds_while_serving": (
        "omnistage_builds_while_serving",
        "Triton kernels and torch.compile graphs built after start-up: each stalled the step that needed "
        "it (the log names them)",
    ),
}


# The counters read from the pipeline's stats at scrape time, by stat: the engine counts, the scrape reports.
_STAT_COUNTERS = {
    "prefix_cache_queries": (
        "omnistage_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache at admission (again at each readmission)",
    ),
    "prefix_cache_hits": (
        "omnistage_prefix_cache_hits",
        "Prompt tokens found in the prefix cache at admission: their prefill was skipped",
    ),
    "talker_prefix_cache_queries": (
        "omnistage_talker_prefix_cache_queries",
        "The Talker's prompt rows looked up in its prefix cache at admission (again at each readmission)",
    ),
    "talker_prefix_cache_hits": (
        "omnistage_talker_prefix_cache_hits",
        "The Talker's prompt rows found in its prefix cache (earlier turns' user rows): their prefill was skipped",
    ),
    "encoder_cache_hits": (
        "omnistage_encoder_cache_hits",
        "Audio clips whose encoder rows were kept from an earlier request: the audio tower did not run",
    ),
    "encoder_cache_misses": (
        "omnistage_encoder_cache_misses",
        "Audio clips the audio tower encoded (their rows kept for later requests where the cache is on)",
    ),
}


class _StatCounters(Collector):
    """The engine's own running totals as Prometheus counters (`<name>_total`), as of the last scrape."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for stat, (name, help) in _STAT_COUNTERS.items():
            yield CounterMetricFamily(name, help, value=self.stats.get(stat, 0))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes and the other process_* gauges the default registry has: what a soak
        # watches for leaks through /metrics (benchmarks/soak.py)
        ProcessCollector(registry=r)
        self.requests = Counter(
            "omnistage_requests",
            "Requests by endpoint and outcome (HTTP status, or 'cancelled' when the client left)",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "omnistage_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("omnistage_generation_tokens", "Tokens generated", registry=r)
        self.ttft = self._histogram(
            "omnistage_time_to_first_token_seconds", "Arrival to first token", _TTFT_BUCKETS
        )
        self.tpot = self._histogram(
            "omnistage_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            _TPOT_BUCKETS,
        )
        self.e2e = self._histogram("omnistage_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS)
        self.phases = self._histogram(
            "omnistage_request_phase_seconds",
            _PHASES_HELP,
            _TTFT_BUCKETS,
            ["phase"],
        )
        self.first_audio = self._histogram(
            "omnistage_time_to_first_audio_seconds",
            "Arrival to the first decoded audio chunk of a spoken reply",
            _TTFT_BUCKETS,
        )
        self.realtime_sessions = Gauge(
            "omnistage_realtime_sessions", "Realtime sessions open (/v1/realtime)", registry=r
        )
        self.realtime_responses = Counter(
            "omnistage_realtime_responses",
            "Realtime responses (turns) by how they ended: completed, cancelled, incomplete or failed",
            ["status"],
            registry=r,
        )
        self.realtime_barge_ins = Counter(
            "omnistage_realtime_barge_ins",
            "Realtime responses cut short by the user speaking (server VAD) or by the client's response.cancel",
            registry=r,
        )
        self.realtime_first_audio = self._histogram(
            "omnistage_realtime_first_audio_seconds",
            "The end of the user's speech (VAD's stop, or the commit) to the first audio delta sent",
            _TTFT_BUCKETS,
        )
        self.realtime_phases = self._histogram(
            "omnistage_realtime_phase_seconds", _REALTIME_PHASES_HELP, _TTFT_BUCKETS, ["phase"]
        )
        self.stat_gauges = {
            stat: Gauge(name, help, registry=r) for stat, (name, help) in _STAT_GAUGES.items()
        }
        self.stat_counters = _StatCounters()
        r.register(self.stat_counters)

    def _histogram(
        self, name: str, help: str, buckets: tuple[float, ...], labels: list[str] | None = None
    ) -> Histogram:
        return Histogram(name, help, labels or [], buckets=buckets, registry=self.registry)

    def set_plan(self, frontend: Frontend) -> None:
        """The pipeline's memory plans: one gauge per sample name (each name has one set of labels)."""
        gauges: dict[str, Gauge] = {}
        help = frontend.plan_gauge_help
        for sample in frontend.plan_gauges:
            if sample.name not in gauges:
                gauges[sample.name] = Gauge(
                    sample.name, help[sample.name], sorted(sample.labels), registry=self.registry
                )
            gauges[sample.name].labels(**sample.labels).set(sample.value)

    def count(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def parsed(self, arrived: float | None, received: float | None) -> None:
        """A request's handler starts: its receive phase (its headers in to its body in) and its parse phase
        (the body parsed and validated, from when it was in)."""
        if arrived is not None and received is not None:
            self.phases.labels("receive").observe(received - arrived)
            self.phases.labels("parse").observe(time.monotonic() - received)

    def prepared(self, received: float | None) -> None:
        """A request handed over to the engine: its prepare phase, from when its body was in (gate.py)."""
        if received is not None:
            self.phases.labels("prepare").observe(time.monotonic() - received)

    def responded(self, delivered: float | None) -> None:
        """A stream's first chunk is written: its respond phase, from its first output reaching the handler."""
        if delivered is not None:
            self.phases.labels("respond").observe(time.monotonic() - delivered)

    def observe(self, output: RequestOutput) -> None:
        """Token counts and latencies of a request that has ended (finished or cancelled)."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        generated = len(output.outputs[0].token_ids) if output.outputs else 0
        self.generation_tokens.inc(generated)
        times = output.metrics
        arrival, first, finished = times.get("arrival"), times.get("first_token"), times.get("finished")
        if arrival is not None and first is not None:
            self.ttft.observe(first - arrival)
        submitted, delivered = times.get("submitted"), times.get("delivered")
        if submitted is not None and arrival is not None and first is not None:
            self.phases.labels("to_engine").observe(arrival - submitted)
            self.phases.labels("first_token").observe(first - arrival)
            if delivered is not None:  # a response not streamed delivers no first token on its own
                self.phases.labels("delivery").observe(delivered - first)
        if arrival is not None and "first_audio" in times:
            self.first_audio.observe(times["first_audio"] - arrival)
        if first is not None and finished is not None and generated > 1:
            self.tpot.observe((finished - first) / (generated - 1))
        if arrival is not None and finished is not None:
            self.e2e.observe(finished - arrival)

    def realtime_turn(self, speech_ended: float, times: Mapping[str, float], sent: float) -> None:
        """The phases of a realtime turn that spoke: from `speech_ended` through its output's `times` to its
        first audio delta `sent` (monotonic seconds). A mark the output lacks leaves its time to the next."""
        marks = {**times, "sent": sent}
        last = speech_ended
        for mark, phase in _REALTIME_MARKS:
            if mark in marks:
                self.realtime_phases.labels(phase).observe(marks[mark] - last)
                last = marks[mark]

    def render(self, stats: dict[str, int]) -> bytes:
        """The exposition text, with the engine gauges refreshed from `stats`."""
        for stat, gauge in self.stat_gauges.items():
            if stat in stats:
                gauge.set(stats[stat])
        self.stat_counters.stats = stats
        return generate_latest(self.registry)
