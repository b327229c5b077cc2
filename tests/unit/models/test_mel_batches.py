"""The thread that runs the GPU mel's batches (`_Batches`), with a fake batch on the CPU: each caller gets its
own clip's result, clips that arrive while a batch runs share the next one, a batch is bounded by its
samples, and a failing batch fails its own clips only."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from omnistage.models.qwen3_omni.audio_features import _Batches


class FakeMel:
    """Each clip's samples doubled, as a tensor; the first batch waits until `release` is set, so that the
    clips submitted meanwhile pile up behind it."""

    def __init__(self, fail_with: float | None = None) -> None:
        self.sizes: list[int] = []
        self.release = threading.Event()
        self.fail_with = fail_with

    def __call__(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        self.sizes.append(len(clips))
        if len(self.sizes) == 1:
            assert self.release.wait(10)
        if self.fail_with is not None and any(c[0] == self.fail_with for c in clips):
            raise RuntimeError("device error")
        return [torch.from_numpy(c * 2) for c in clips]


def clips(n: int, size: int = 100) -> list[np.ndarray]:
    return [np.full(size, float(i), np.float32) for i in range(n)]


def submit_all(batches: _Batches, fake: FakeMel, inputs: list[np.ndarray]) -> list:
    """Submit the first clip, wait until its batch has started and the others wait behind it, then let the
    first batch end."""
    with ThreadPoolExecutor(len(inputs)) as pool:
        first = pool.submit(batches.submit, inputs[0])
        while not fake.sizes:
            threading.Event().wait(0.001)
        rest = [pool.submit(_result_or_error, batches, c) for c in inputs[1:]]
        while len(batches._pending) < len(inputs) - 1:  # all submitted, behind the running batch
            threading.Event().wait(0.001)
        fake.release.set()
        return [first.result(), *[f.result() for f in rest]]


def _result_or_error(batches: _Batches, clip: np.ndarray) -> torch.Tensor | Exception:
    try:
        return batches.submit(clip)
    except RuntimeError as exc:
        return exc


def test_clips_that_arrive_during_a_batch_share_the_next_and_get_their_own_features():
    fake = FakeMel()
    batches = _Batches(fake, most=10_000, name="test-mel")
    inputs = clips(24)
    got = submit_all(batches, fake, inputs)
    for clip, features in zip(inputs, got, strict=True):
        assert torch.equal(features, torch.from_numpy(clip * 2))
    assert fake.sizes[0] == 1 and sum(fake.sizes) == 24 and len(fake.sizes) <= 3, fake.sizes


def test_a_batch_holds_at_most_its_samples():
    fake = FakeMel()
    batches = _Batches(fake, most=500, name="test-mel")
    inputs = clips(21)  # 100 samples each: the 20 behind the first go five at a time
    got = submit_all(batches, fake, inputs)
    assert all(torch.equal(f, torch.from_numpy(c * 2)) for c, f in zip(inputs, got, strict=True))
    assert fake.sizes == [1, 5, 5, 5, 5]


def test_a_failing_batch_fails_its_clips_and_the_next_batch_runs():
    fake = FakeMel(fail_with=3.0)
    batches = _Batches(fake, most=300, name="test-mel")
    inputs = clips(7)  # batches: [0], [1, 2, 3] (fails), [4, 5, 6]
    got = submit_all(batches, fake, inputs)
    assert fake.sizes == [1, 3, 3]
    assert [isinstance(g, RuntimeError) for g in got] == [False, True, True, True, False, False, False]
    assert torch.equal(got[6], torch.from_numpy(inputs[6] * 2))
    with pytest.raises(RuntimeError, match="device error"):
        batches.submit(np.full(10, 3.0, np.float32))
    assert torch.equal(batches.submit(np.ones(10, np.float32)), torch.full((10,), 2.0))


def test_a_batch_given_too_few_features_fails_its_clips_and_the_thread_serves_on():
    answers = iter([[], [torch.ones(3)]])
    batches = _Batches(lambda clips: next(answers), most=10, name="test-mel")
    assert isinstance(within(10, batches.submit, np.zeros(3, np.float32)), ValueError)
    assert torch.equal(within(10, batches.submit, np.zeros(3, np.float32)), torch.ones(3))


def within(seconds: float, call, *args):
    """`call(*args)`'s result or exception, from a daemon thread: a caller left waiting fails the test
    instead of hanging it."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            out.put(call(*args))
        except Exception as exc:
            out.put(exc)

    threading.Thread(target=run, daemon=True).start()
    return out.get(timeout=seconds)
