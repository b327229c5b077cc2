import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.server.metrics import ServerMetrics

ENGINE = {"num_waiting": 2, "num_running": 3, "kv_pages_total": 10, "kv_pages_free": 6, "kv_pages_used": 4}


def samples(text: bytes) -> dict[str, float]:
    return {
        s.name: s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples
    }


def test_engine_gauges_are_read_at_scrape_time():
    found = samples(ServerMetrics().render(ENGINE))
    assert found["omnistage_num_requests_waiting"] == 2
    assert found["omnistage_kv_pages_used"] == 4
    assert found["omnistage_kv_pages_free"] == 6


def test_gpu_allocator_gauges_appear_with_a_gpu_engine():
    gpu = {**ENGINE, "gpu_memory_reserved_bytes": 3 << 30, "gpu_alloc_retries": 5}
    found = samples(ServerMetrics().render(gpu))
    assert found["omnistage_gpu_memory_reserved_bytes"] == 3 << 30
    assert found["omnistage_gpu_alloc_retries"] == 5
    assert samples(ServerMetrics().render(ENGINE))["omnistage_gpu_alloc_retries"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prometheus-client reads /proc")
def test_the_process_resident_memory_is_a_gauge():
    assert samples(ServerMetrics().render(ENGINE))["process_resident_memory_bytes"] > 0


def test_prefix_cache_totals_are_counters_read_at_scrape_time():
    metrics = ServerMetrics()
    assert samples(metrics.render(ENGINE))["omnistage_prefix_cache_hits_total"] == 0
    stats = {**ENGINE, "prefix_cache_queries": 120, "prefix_cache_hits": 48, "kv_pages_cached": 12}
    text = metrics.render(stats)
    found = samples(text)
    assert found["omnistage_prefix_cache_queries_total"] == 120
    assert found["omnistage_prefix_cache_hits_total"] == 48
    assert found["omnistage_kv_pages_cached"] == 12
    assert b"# TYPE omnistage_prefix_cache_hits_total counter" in text
