"""GraphSet's contract on the CPU: one replay over filled buffers, tuple buckets in groups, the one way a
bucket's graph is priced (over a fake device peak), and one capture stream per device."""

from __future__ import annotations

import contextlib

import pytest
import torch

import omnistage.engine.graphs.base as base
from omnistage.engine.graphs.base import GraphSet, graph_peaks, groups
from omnistage.engine.memory.measure import Peak, scaled_peaks


class RowBuffers:
    """Rows of one ladder, or of several (`groups`: bucket (g, n) uses the first n rows of group g's)."""

    def __init__(self, capacity: int, groups: tuple[int, ...] = ()) -> None:
        self.capacity = capacity
        self.rows = {g: torch.zeros(capacity) for g in groups or (None,)}

    def _rows(self, bucket) -> torch.Tensor:
        group, size = (None, bucket) if isinstance(bucket, int) else bucket
        return self.rows[group][:size]

    def args(self, bucket) -> tuple:
        return (self._rows(bucket),)

    def clear(self, bucket) -> None:
        self._rows(bucket).zero_()

    def fill(self, rows: torch.Tensor, bucket) -> None:
        self.clear(bucket)
        self._rows(bucket)[: len(rows)].copy_(rows)


class Step:
    """Doubles its rows and remembers how many it was given."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(rows.shape[0])
        return rows * 2


def test_replay_fills_the_bucket_and_returns_its_outputs():
    step = Step()
    graphs = GraphSet(step, RowBuffers(8), "cpu")
    assert graphs.capture([2, 4, 8]) == [2, 4, 8] and graphs.graph_count == 0  # static-eager off CUDA
    replayed: list = []
    graphs.on_replay = replayed.append
    bucket = graphs.bucket_for(3)
    out = graphs.replay(bucket, torch.tensor([1.0, 2.0, 3.0]))
    assert bucket == 4 and replayed == [4] and step.calls == [4]
    assert out.tolist() == [2.0, 4.0, 6.0, 0.0]  # the padding row is zero
    graphs.buffers.rows[None][3] = 5.0
    assert graphs.replay(4).tolist() == [2.0, 4.0, 6.0, 10.0]  # no inputs: what the buffers hold
    assert graphs.bucket_for(9) is None
    with pytest.raises(ValueError, match="exceeds the static buffers' 8 rows"):
        graphs.capture([16])


def test_tuple_buckets_fit_within_their_group():
    graphs = GraphSet(Step(), RowBuffers(4, groups=(2, 25)), "cpu")
    assert graphs.capture([(25, 4), (2, 1), (2, 4), (25, 1)]) == [(2, 1), (2, 4), (25, 1), (25, 4)]
    assert graphs.bucket_for(2, (2,)) == (2, 4) and graphs.bucket_for(1, (25,)) == (25, 1)
    assert graphs.bucket_for(1, (7,)) is None and graphs.bucket_for(5, (2,)) is None
    assert graphs.replay((25, 4), torch.ones(3)).tolist() == [2.0, 2.0, 2.0, 0.0]
    assert list(groups([(2, 1), (25, 4), (25, 1), (2, 4)]).items()) == [
        ((25,), [(25, 1), (25, 4)]),
        ((2,), [(2, 1), (2, 4)]),
    ]  # largest group first, as captured; each ascending


@pytest.fixture
def fake_peak(monkeypatch) -> list[int]:
    """A device peak of 1000 bytes a row of the last step (10 of them kept); returns the rows each measured."""
    measured: list[int] = []

    @contextlib.contextmanager
    def device_peak(device):
        peak, before = Peak(), len(measured)
        yield peak
        assert len(measured) == before + 1  # one step in each measure
        peak.bytes, peak.kept = 1000 * measured[-1], 10 * measured[-1]

    monkeypatch.setattr(base, "device_peak", device_peak)
    return measured


class MeasuredStep(Step):
    def __init__(self, measured: list[int]) -> None:
        super().__init__()
        self.calls = measured


def test_a_set_is_priced_from_its_largest_bucket_per_group(fake_peak):
    graphs = GraphSet(MeasuredStep(fake_peak), RowBuffers(8, groups=(2, 25)), "cpu")
    assert graphs.graph_costs([(2, 1), (2, 8)]) == {}  # off CUDA nothing is captured, so nothing priced
    graphs.device = torch.device("cuda")
    costs = graphs.graph_costs([(2, 1), (2, 4), (25, 2), (25, 8), (2, 8)])
    assert fake_peak == [8, 8]  # (25, 8), then (2, 8)
    scaled = scaled_peaks(Peak(8000, 80), [1, 4, 8])
    assert list(costs) == [(25, 2), (25, 8), (2, 1), (2, 4), (2, 8)]
    assert costs[(2, 4)] == scaled[4] and costs[(25, 2)] == scaled_peaks(Peak(8000, 80), [2, 8])[2]
    graphs.enforce_eager = True
    assert graphs.graph_costs([1, 2]) == {}


def test_sets_made_for_each_bucket_are_each_measured(fake_peak):
    """The encoders' way: a set made inside each measure (its buffers counted), every bucket measured."""
    made: list[int] = []

    def make(bucket: int) -> GraphSet:
        made.append(bucket)
        return GraphSet(MeasuredStep(fake_peak), RowBuffers(bucket), "cpu")

    costs = graph_peaks(make, [4, 1, 2], torch.device("cuda"), scaled=False)
    assert made == fake_peak == [1, 2, 4]
    assert costs == {b: Peak(1000 * b, 10 * b) for b in (1, 2, 4)}


def test_one_capture_stream_per_device(monkeypatch):
    """Every graph set of a device captures on one stream (the allocator shares a pool's scratch only within
    a stream), and a set on another device on that device's own; "cuda" is the current device."""
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    base._capture_stream.cache_clear()
    try:
        first = base.capture_stream(torch.device("cuda", 1))
        assert base.capture_stream(torch.device("cuda")) is first
        assert base.capture_stream(torch.device("cuda", 0)) is not first
        assert made == [torch.device("cuda", 1), torch.device("cuda", 0)]
    finally:
        base._capture_stream.cache_clear()
