"""SideStream on a GPU: a step submitted beside starts after the marked work of the caller's stream (not after
the caller's later work), runs on its own stream, and the caller's stream reads its results after `join`."""

import pytest
import torch

from omnistage.pipeline.side_stream import SideStream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_marked_work_before_the_step_beside_and_the_join_after_it():
    device = torch.device("cuda", torch.cuda.current_device())
    side = SideStream(device, "test")
    kv = torch.zeros(1 << 20, device=device)
    # a step beside allocates from the side stream's cached blocks, as a warm pipeline's does: a block the
    # allocator had to get from the driver first (cudaMalloc) would wait for the device's queued work
    warm = side.join(side.submit(lambda: kv * 2))
    del warm
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time queued before the write the step must see
    kv.fill_(3.0)
    side.mark()
    later = torch.zeros(1, device=device)
    torch.cuda._sleep(2_000_000_000)  # the caller's own later work (~1 s): the step must not wait for it
    later.fill_(1.0)
    later_done = torch.cuda.Event(enable_timing=True)
    later_done.record()
    step_done = torch.cuda.Event(enable_timing=True)

    def step() -> torch.Tensor:
        assert torch.cuda.current_stream(device) == side.stream
        out = kv * 2
        step_done.record()
        return out

    out = side.join(side.submit(step))
    assert torch.cuda.current_stream(device) != side.stream
    assert torch.equal(out, torch.full_like(kv, 6.0))  # it waited for the marked write
    assert later.item() == 1.0
    # the step ended well before the caller's later sleep did: it waited for the mark, not for that sleep
    assert step_done.elapsed_time(later_done) > 100.0
    side.close()
