import math

import pytest

from omnistage.bench.stats import RequestTiming, median, percentile, real_time_factor, summarize


def test_percentile_interpolates_between_ranks():
    data = [4.0, 1.0, 3.0, 2.0]
    assert percentile(data, 0) == 1.0 and percentile(data, 100) == 4.0
    assert percentile(data, 50) == 2.5
    assert percentile(data, 90) == pytest.approx(3.7)
    assert median([5.0, 1.0, 3.0]) == 3.0


def test_percentile_skips_nan_and_handles_empty():
    assert median([math.nan, 2.0, 4.0]) == 3.0
    assert math.isnan(median([])) and math.isnan(median([math.nan]))
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def test_real_time_factor():
    assert real_time_factor(94.0, 4.7) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="wall time must be positive"):
        real_time_factor(1.0, 0.0)


def test_tpot_excludes_the_first_token():
    t = RequestTiming(audio_s=5.0, ttft_s=0.08, latency_s=0.08 + 32 * 0.01, output_tokens=33)
    assert t.tpot_s == pytest.approx(0.01)
    assert math.isnan(RequestTiming(1.0, 0.1, 0.1, 1).tpot_s)


def test_summarize_one_pass():
    timings = [
        RequestTiming(2.0, 0.05, 0.15, 11),
        RequestTiming(6.0, 0.07, 0.27, 21),
        RequestTiming(4.0, 0.06, 0.16, 11),
    ]
    s = summarize(timings, wall_s=0.6, concurrency=4)
    assert s["concurrency"] == 4 and s["requests"] == 3 and s["audio_s"] == 12.0
    assert s["rtf"] == 20.0
    assert s["ttft_median_ms"] == 60.0
    assert s["tpot_median_ms"] == 10.0
    assert s["latency_median_ms"] == 160.0
    assert s["output_tokens"] == 43


def test_summarize_several_passes_takes_the_median_pass_wall():
    one_pass = [RequestTiming(5.0, 0.08, 0.24, 33, {"encode": 0.004, "prefill": 0.05})]
    slower = [RequestTiming(5.0, 0.10, 0.30, 33, {"encode": 0.006, "prefill": 0.07})]
    faster = [RequestTiming(5.0, 0.07, 0.20, 33, {"encode": 0.002, "prefill": 0.04})]
    s = summarize(one_pass + slower + faster, wall_s=[0.25, 0.31, 0.2], concurrency=1)
    assert s["passes"] == 3 and s["requests"] == 1 and s["audio_s"] == 5.0
    assert s["wall_s"] == 0.25 and s["rtf"] == 20.0
    assert s["rtf_per_pass"] == [20.0, pytest.approx(16.129), 25.0]
    assert s["ttft_median_ms"] == 80.0 and s["output_tokens"] == 33
    assert s["stages_median_ms"] == {"encode": 4.0, "prefill": 50.0}
    assert s["stages_mean_ms"] == {"encode": 4.0, "prefill": pytest.approx(53.33, abs=0.01)}
    with pytest.raises(ValueError, match="3 requests do not split into 2 equal passes"):
        summarize(one_pass + slower + faster, wall_s=[0.2, 0.3], concurrency=1)
