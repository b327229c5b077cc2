"""The buckets a graph set captures and which one a step replays (engine/buckets.py)."""

import pytest

from omnistage.engine.buckets import bucket_for, decode_buckets, faster_buckets, prefill_buckets


def test_default_buckets():
    assert decode_buckets() == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert decode_buckets(512)[-4:] == [192, 256, 384, 512]


def test_prefill_buckets():
    assert prefill_buckets() == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert prefill_buckets(8) == [8]
    with pytest.raises(ValueError):
        prefill_buckets(0)


def test_buckets_end_at_max():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_bucket_for_and_padding():
    buckets = decode_buckets(64)
    assert [bucket_for(b, buckets) for b in (1, 2, 3, 5, 9, 17, 25, 33, 64)] == [
        1,
        2,
        4,
        8,
        16,
        24,
        32,
        48,
        64,
    ]
    assert bucket_for(65, buckets) is None
    # Not every bucket captured: the next captured one up is used.
    assert bucket_for(3, [1, 8]) == 8
    with pytest.raises(ValueError):
        bucket_for(0, buckets)


def test_faster_buckets_pad_only_to_a_clearly_faster_larger_bucket():
    # measured like the code predictor's frames on an H200: 8 rows beat 1, 2 and 4; 16 and 32 cost more
    replay_ms = {1: 4.9, 2: 4.8, 4: 4.3, 8: 3.6, 16: 3.8, 32: 4.6}
    assert faster_buckets(replay_ms) == {1: 8, 2: 8, 4: 8, 8: 8, 16: 16, 32: 32}
    # a MoE decode: every padding row costs, nothing moves
    assert faster_buckets({1: 2.0, 2: 2.4, 4: 3.1}) == {1: 1, 2: 2, 4: 4}
    # within the margin (noise) a batch keeps its own bucket; the fastest larger one wins, not the first
    assert faster_buckets({1: 1.0, 2: 0.97, 4: 0.9, 8: 0.5}) == {1: 8, 2: 8, 4: 8, 8: 8}
    assert faster_buckets({1: 1.0, 2: 0.97}) == {1: 1, 2: 2}
    assert faster_buckets({1: 1.0, 2: 0.9}, margin=0.2) == {1: 1, 2: 2}
    assert faster_buckets({}) == {}
