"""Host-built step tensors reach the GPU through one pinned copy, with the values the CPU path has."""

import pytest
import torch

from omnistage.models.layers.attention_metadata import AttentionMetadata, cat_to_device, to_device_together

pytestmark = pytest.mark.gpu


def test_tensors_arrive_whole_through_one_buffer():
    hosts = [
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.int32).view(2, 3),
        torch.randn(5),
        torch.arange(4).expand(3, 4),
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([[1.5]], dtype=torch.float64),
    ]
    moved = to_device_together(hosts, "cuda")
    torch.cuda.synchronize()
    for host, out in zip(hosts, moved):
        assert out.is_cuda and (out.dtype, out.shape) == (host.dtype, host.shape)
        assert torch.equal(out.cpu(), host)


def test_metadata_on_the_gpu_equals_the_host_build():
    chunks = [(5, 3, [7, 2]), (0, 1, [4]), (9, 1, [1, 3, 6])]
    host = AttentionMetadata.build(chunks, 4, pad_seqs=2, pad_rows=1, max_pages=5)
    ids = torch.tensor([11, 12, 13, 14, 15])
    meta, (ids_out,) = host.to_device("cuda", ids)
    built = AttentionMetadata.build(chunks, 4, "cuda", pad_seqs=2, pad_rows=1, max_pages=5)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(meta, name).cpu(), getattr(host, name)), name
        assert torch.equal(getattr(built, name).cpu(), getattr(host, name)), name
    assert torch.equal(ids_out.cpu(), ids)


def test_pixels_arrive_catted_without_waiting_for_queued_work():
    """A step's pixel pieces (views of a video's patches) arrive catted, and the host does not wait for the
    work queued on the stream before the copy: a ~1 s sleep queued first is still running when it returns."""
    video = torch.randn(4096, 1176)
    parts = [video[:1000], video[1000:1024], video[3000:]]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of clock cycles on the stream
    start = torch.cuda.Event()
    start.record()
    out = cat_to_device(parts, "cuda")
    queued = not start.query()  # the sleep, before the event, still runs
    torch.cuda.synchronize()
    assert queued and out.is_cuda and torch.equal(out.cpu(), torch.cat(parts))
