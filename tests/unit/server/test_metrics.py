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
