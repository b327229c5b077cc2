"""Code2Wav's chunks read back a step late on a GPU (`AudioReadback`): the step that makes them queues their copy
without one wait on the device, and the next step delivers the samples the chunks held when they were made,
though the work before them was still running and their memory was written after."""

import pytest
import torch

from omnistage.models.qwen3_omni.code2wav_streamer import AudioChunk
from omnistage.pipeline.audio_readback import AudioReadback

pytestmark = pytest.mark.gpu


def test_a_deferred_chunk_is_queued_without_waiting_and_delivered_as_made():
    readback = AudioReadback(deferred=True)
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # GPU work still queued when the chunks' copies are
        x = torch.tanh(x @ x) * 0.5
    chunks = [AudioChunk("a", x[0, :960].to(torch.bfloat16), False), AudioChunk("b", x[1, :480], True)]
    made = [c.samples.float().clone() for c in chunks]
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert readback.exchange(chunks, urgent=False) == [] and readback.pending == 2
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.zero_()  # queued after the copies: chunk b is a view of x
    delivered = readback.exchange([], urgent=False)
    assert [c.request_id for c in delivered] == ["a", "b"] and [c.final for c in delivered] == [False, True]
    for got, want in zip(delivered, made, strict=True):
        assert torch.equal(torch.from_numpy(got.samples), want.cpu())
    assert readback.pending == 0
