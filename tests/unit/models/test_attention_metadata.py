"""Host-built step tensors reach the device in one copy, each with its dtype, shape and values."""

import numpy as np
import pytest
import torch

from omnistage.models.layers.attention_metadata import (
    AttentionMetadata,
    _through_one_buffer,
    to_device_together,
)

PAGE = 4


def mixed_tensors() -> list[torch.Tensor]:
    return [
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.int32).view(2, 3),
        torch.randn(5, generator=torch.Generator().manual_seed(0)),
        torch.arange(4).expand(3, 4),  # not contiguous
        torch.zeros(0, dtype=torch.int64),
        torch.from_numpy(np.array([], dtype=np.int64)),  # empty with stride 0
        torch.tensor([[1.5]], dtype=torch.float64),
    ]


def test_one_buffer_gives_back_every_tensor():
    hosts = mixed_tensors()
    moved = _through_one_buffer(hosts, torch.device("cpu"), pin=False)
    assert len(moved) == len(hosts)
    for host, out in zip(hosts, moved):
        assert (out.dtype, out.shape) == (host.dtype, host.shape)
        assert torch.equal(out, host)
    # one buffer: every non-empty tensor is a view of the same storage
    assert len({t.untyped_storage().data_ptr() for t in moved if t.numel()}) == 1
    assert _through_one_buffer([], torch.device("cpu"), pin=False) == []


def test_every_tensor_starts_16_byte_aligned_in_the_buffer():
    """Triton specializes a pointer on 16-byte alignment: a tensor starting wherever the one before ended would
    build a new kernel variant mid-request whenever a step's sizes moved it (a block table after a batch of an odd
    number of int32 sequence lengths, measured on the H200: 0.7-1 s)."""
    for batch in range(1, 6):
        hosts = [
            torch.zeros(batch + 1, dtype=torch.int32),
            torch.ones(batch, 3, dtype=torch.int32),
            *mixed_tensors(),
        ]
        moved = _through_one_buffer(hosts, torch.device("cpu"), pin=False)
        assert all(t.data_ptr() % 16 == 0 for t in moved if t.numel())
        assert all(torch.equal(out, host) for out, host in zip(moved, hosts))


def test_to_device_together_on_the_cpu_is_the_tensors_themselves():
    hosts = mixed_tensors()
    assert all(out is host for out, host in zip(to_device_together(hosts, "cpu"), hosts))


def test_metadata_moves_with_the_step_tensors():
    host = AttentionMetadata.build([(5, 3, [7, 2]), (0, 1, [4])], PAGE, pad_seqs=1)
    ids, positions = torch.tensor([3, 1, 4, 1]), torch.arange(12).view(3, 4)
    meta, (ids_out, positions_out) = host.to_device("cpu", ids, positions)
    assert torch.equal(ids_out, ids) and torch.equal(positions_out, positions)
    assert meta.slot_mapping.tolist() == [2 * PAGE + 1, 2 * PAGE + 2, 2 * PAGE + 3, 4 * PAGE, -1]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 5]
    assert meta.seq_lens.tolist() == [8, 1, 0]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0], [0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 8)


def test_block_tables_take_a_fixed_width_and_padding_only_steps():
    meta = AttentionMetadata.build([(0, 1, [3])], PAGE, max_pages=4)
    assert meta.block_tables.tolist() == [[3, 0, 0, 0]] and meta.block_tables.dtype == torch.int32
    padding = AttentionMetadata.build([], PAGE, pad_seqs=2, pad_rows=1)
    assert padding.slot_mapping.tolist() == [-1, -1, -1]
    assert padding.query_start_loc.tolist() == [0, 1, 2]
    assert padding.block_tables.tolist() == [[0], [0]]
    assert (padding.max_query_len, padding.max_seq_len) == (1, 0)
    empty = AttentionMetadata.build([], PAGE)
    assert empty.block_tables.shape == (0, 1) and (empty.max_query_len, empty.max_seq_len) == (0, 0)


def test_random_steps_equal_the_per_row_definition():
    """Every row's slot is its page's first slot plus its offset in the page; every sequence's table is its pages
    in order, padded with 0 (the module's docstring), for steps of decodes, prefill chunks and padding."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        chunks = []
        for _ in range(int(rng.integers(0, 9))):
            start, new = int(rng.integers(0, 70)), int(rng.integers(0, 40))
            pages = rng.permutation(500)[: -(-(start + new) // PAGE) + int(rng.integers(0, 3))].tolist()
            chunks.append((start, new, pages))
        pad_seqs, pad_rows = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        meta = AttentionMetadata.build(chunks, PAGE, pad_seqs=pad_seqs, pad_rows=pad_rows)
        slots = [pages[p // PAGE] * PAGE + p % PAGE for s, n, pages in chunks for p in range(s, s + n)]
        assert meta.slot_mapping.tolist() == slots + [-1] * (pad_seqs + pad_rows)
        query_lens = [n for _, n, _ in chunks] + [1] * pad_seqs
        assert meta.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        assert meta.seq_lens.tolist() == [s + n for s, n, _ in chunks] + [0] * pad_seqs
        width = max([len(p) for _, _, p in chunks] + [1])
        assert (
            meta.block_tables.tolist()
            == [p + [0] * (width - len(p)) for _, _, p in chunks] + [[0] * width] * pad_seqs
        )
        assert meta.max_query_len == max(query_lens, default=0)
        assert meta.max_seq_len == max([s + n for s, n, _ in chunks], default=0)
        assert meta.num_keys == (0 if pad_seqs or pad_rows else sum(s + n for s, n, _ in chunks))


def test_a_chunk_without_its_pages_or_with_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="9 tokens need 3 pages of 4, got 2"):
        AttentionMetadata.build([(0, 1, [1]), (5, 4, [7, 2])], PAGE)
    with pytest.raises(ValueError, match="must be non-negative"):
        AttentionMetadata.build([(0, 1, [1]), (3, -1, [7])], PAGE)
    with pytest.raises(ValueError, match="max_pages=1"):
        AttentionMetadata.build([(5, 1, [7, 2])], PAGE, max_pages=1)
