"""memory.measure's pricing helpers: a measured step scaled to each bucket, split into what a graph keeps and the
scratch its pool shares."""

from omnistage.engine.memory.measure import Peak, graph_candidates, scaled_peaks
from omnistage.engine.memory.plan import MAIN_POOL, MiB, scaled_costs


def test_scaled_peaks_scale_bytes_and_kept_and_keep_kept_within_bytes():
    peaks = scaled_peaks(Peak(64 * MiB, 8 * MiB), [1, 4, 16])
    assert {b: p.bytes for b, p in peaks.items()} == scaled_costs(64 * MiB, [1, 4, 16])
    assert {b: p.kept for b, p in peaks.items()} == scaled_costs(8 * MiB, [1, 4, 16])
    assert peaks[16].kept < peaks[16].bytes
    # a step that keeps all it took: every graph is kept bytes, no scratch
    whole = scaled_peaks(Peak(4 * MiB, 4 * MiB), [1, 2])
    assert all(p.kept == p.bytes for p in whole.values())


def test_graph_candidates_carry_what_each_bucket_keeps():
    sets = graph_candidates(
        "Talker", "decode", "batch", scaled_peaks(Peak(64 * MiB, 8 * MiB), [1, 4, 16]), MAIN_POOL
    )
    assert sets.pool_name == MAIN_POOL and sets.label == "Talker decode"
    kept, scratch = sets.split(16)
    assert kept == scaled_costs(8 * MiB, [1, 4, 16])[16]
    assert kept + scratch == scaled_costs(64 * MiB, [1, 4, 16])[16]
