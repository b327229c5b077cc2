"""The Triton paged-attention kernels of `kernels/attention.py` and the backend that calls them
(`engine/attention/cuda.py`), run on the CPU by Triton's interpreter.

Triton picks interpreted or compiled kernels when `triton.language` is first imported, so the kernels
run in a child pytest with TRITON_INTERPRET=1 set from its start; in the parent this file is one test
that launches it (a process with compiled kernels, e.g. the GPU tests, stays untouched). Run directly:
`TRITON_INTERPRET=1 pytest tests/unit/kernels/test_attention.py`.
"""

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

from omnistage.engine.attention import AttentionMetadata, TorchReferenceBackend

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernels_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    import dataclasses

    from omnistage.engine.attention.cuda import CudaAttentionBackend
    from omnistage.kernels import attention
    from omnistage.kernels.attention import PREFILL_TILES, Tiles, decode_splits, paged_attention, write_kv

    def _case(chunks, heads, kv_heads, dim, page_size, num_pages, seed, pad_seqs=0, pad_rows=0, dtype=None):
        g = torch.Generator().manual_seed(seed)
        meta = AttentionMetadata.build(chunks, page_size, pad_seqs=pad_seqs, pad_rows=pad_rows)
        rows = meta.slot_mapping.shape[0]
        cache = torch.randn(2, num_pages, page_size, kv_heads, dim, generator=g)
        q = torch.randn(rows, heads, dim, generator=g)
        k = torch.randn(rows, kv_heads, dim, generator=g)
        v = torch.randn(rows, kv_heads, dim, generator=g)
        if dtype is not None:
            q, k, v, cache = (t.to(dtype) for t in (q, k, v, cache))
        return q, k, v, cache, meta

    def _reference(q, k, v, cache, meta, scale):
        """Oracle in float64: the torch reference backend on upcast copies."""
        cache64 = cache.double()
        out = TorchReferenceBackend().forward(q.double(), k.double(), v.double(), cache64, meta, scale)
        return out, cache64

    def _check(case, num_splits=None, tiles=PREFILL_TILES, varlen=False):
        q, k, v, cache, meta = case
        scale = q.shape[-1] ** -0.5
        expected, expected_cache = _reference(q, k, v, cache, meta, scale)
        cache = cache.clone()
        write_kv(cache, k, v, meta.slot_mapping)
        assert torch.equal(cache.double(), expected_cache)
        # Poisoned output: every row of a sequence must be written, rows of none keep the poison.
        out = torch.full_like(q, float("nan"))
        paged_attention(q, cache, meta, scale, out=out, num_splits=num_splits, tiles=tiles, varlen=varlen)
        in_seq = torch.zeros(q.shape[0], dtype=torch.bool)
        in_seq[: int(meta.query_start_loc[-1])] = True
        assert not out[in_seq].isnan().any()
        assert out[~in_seq].isnan().all()
        got = out[in_seq].double()
        want = expected[in_seq]
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        # The backend as the model calls it: padding rows are zeros.
        full = CudaAttentionBackend().forward(q, k, v, case[3].clone(), meta, scale)
        assert torch.allclose(full.double(), expected, atol=1e-5, rtol=1e-5)

    def test_ragged_prefill_over_cached_pages():
        # Fresh prompt, a chunk after cached tokens crossing page borders, a decode row, out-of-order pages.
        chunks = [(0, 7, [3, 5]), (5, 9, [0, 9, 11, 2]), (10, 1, [1, 4, 6]), (0, 1, [7])]
        _check(_case(chunks, 8, 2, 32, 4, 16, seed=0, pad_rows=3))

    def test_prefill_longer_than_a_tile():
        chunks = [(3, 70, list(range(0, 19))), (0, 20, list(range(19, 24)))]
        _check(_case(chunks, 4, 4, 16, 4, 32, seed=1))
        _check(_case(chunks[:1], 4, 4, 16, 4, 32, seed=1, pad_rows=9))  # one sequence: no search
        for tiles in (Tiles(rows=128, keys=32), Tiles(rows=16, keys=128, warps=8, stages=2)):
            _check(_case(chunks, 8, 2, 16, 4, 32, seed=6, pad_rows=5), tiles=tiles)

    def test_long_prompt_chunks_go_to_the_varlen_kernel_and_the_rest_stay_paged(monkeypatch):
        from omnistage.engine.attention import long_prefill

        # thresholds this small case crosses; FlashAttention's stand-in is the reference over the same pages
        monkeypatch.setattr(long_prefill, "MIN_KEYS", 40)
        monkeypatch.setattr(long_prefill, "MIN_ROWS", 16)
        calls = []

        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
            return paged_attention(q, case[3], case[4], scale)  # the pages the keys came from

        long_step = [(30, 16, list(range(0, 12))), (20, 1, list(range(12, 18)))]
        decode_step = [(45, 1, list(range(0, 12))), (20, 1, list(range(12, 18)))]
        # FlashAttention takes 16-bit queries: a float32 model's long chunks stay on the paged kernel
        for chunks, dtype, gathered in (
            (long_step, torch.float16, True),
            (decode_step, torch.float16, False),
            (long_step, torch.float32, False),
        ):
            calls.clear()
            case = _case(chunks, 8, 2, 32, 4, 24, seed=8, dtype=dtype)
            q, k, v, cache, meta = case
            write_kv(case[3], k, v, meta.slot_mapping)
            scale = 32**-0.5
            expected, _ = _reference(q, k, v, cache.clone(), meta, scale)
            out = CudaAttentionBackend(flash=varlen).forward(q, k, v, cache.clone(), meta, scale)
            assert torch.allclose(out.double(), expected, atol=2e-3, rtol=2e-3)
            assert calls == ([([0, 16, 17], [0, 46, 67], 16, 46)] if gathered else [])

        # every layer of a step gathers the same keys: their slots are worked out once a step
        computed = []
        slots_of = long_prefill.key_slots
        monkeypatch.setattr(long_prefill, "key_slots", lambda *a: computed.append(1) or slots_of(*a))
        case = _case(long_step, 8, 2, 32, 4, 24, seed=9, dtype=torch.float16)
        backend = CudaAttentionBackend(flash=varlen)
        layers = [backend.attend(case[0], case[3], case[4], 0.2) for _ in range(3)]
        assert len(computed) == 1 and all(torch.equal(layer, layers[0]) for layer in layers)
        backend.attend(case[0], case[3], dataclasses.replace(case[4]), 0.2)  # the next step's metadata
        assert len(computed) == 2

    def test_odd_group_and_head_dim():
        # 6 query heads over 2 KV heads (group 3, padded to 4), head_dim 24 (padded to 32).
        chunks = [(4, 6, [2, 0, 1]), (0, 3, [3])]
        _check(_case(chunks, 6, 2, 24, 4, 8, seed=2))

    def _as_a_prefill_graph_pads(meta, empty_slots):
        """`meta` as a prefill graph's buffers hold it: `empty_slots` sequence slots of no rows past its
        sequences, and a tile height of the whole bucket (every row, padding included)."""
        rows = meta.slot_mapping.shape[0]
        tokens = int(meta.query_start_loc[-1])
        return dataclasses.replace(
            meta,
            query_start_loc=torch.cat([meta.query_start_loc, torch.full((empty_slots,), tokens)]),
            seq_lens=torch.cat([meta.seq_lens, torch.zeros(empty_slots, dtype=meta.seq_lens.dtype)]),
            block_tables=torch.cat(
                [meta.block_tables, meta.block_tables.new_zeros(empty_slots, meta.block_tables.shape[1])]
            ),
            max_query_len=rows,
        )

    def test_short_chunks_beside_decode_rows_in_a_padded_step(monkeypatch):
        # A server under load: decode rows of many sequences and a few prompt chunks (one of several tiles,
        # some starting mid-tile), padded as a prefill graph pads them. Every tile is reached and the programs
        # are tiles numbered across the sequences, not sequences x the bucket's tiles.
        chunks, page = [], 0
        for length, start in [(1, 30), (37, 0), (1, 9), (1, 70), (75, 12), (1, 3), (5, 0), (1, 44), (1, 17)]:
            pages = -(-(start + length) // 4)
            chunks.append((start, length, list(range(page, page + pages))))
            page += pages
        q, k, v, cache, meta = _case(chunks, 8, 2, 32, 4, page + 1, seed=5, pad_rows=23)
        meta = _as_a_prefill_graph_pads(meta, empty_slots=6)
        launched = []
        kernel = attention._paged_attention

        class Recording:
            def __getitem__(self, grid):
                launched.append(grid)
                return kernel[grid]

        monkeypatch.setattr(attention, "_paged_attention", Recording())
        _check((q, k, v, cache, meta))
        rows, seqs, block_q = q.shape[0], meta.seq_lens.shape[0], 64 // 4
        assert launched[0] == (rows // block_q + seqs, 2, 1)
        assert launched[0][0] < seqs * -(-rows // block_q)

    @pytest.mark.parametrize("num_splits", [None, 1, 2, 8])
    def test_decode_split_kv(num_splits):
        page_size = 16
        chunks = [(100, 1, list(range(0, 7))), (200, 1, list(range(7, 20))), (3, 1, [30]), (0, 1, [31])]
        case = _case(chunks, 8, 2, 32, page_size, 40, seed=3, pad_seqs=2)
        _check(case, num_splits=num_splits)

    @pytest.mark.parametrize("tiles", [PREFILL_TILES, Tiles(rows=16)])
    def test_decode_rows_through_the_prefill_tiles(tiles):
        # `varlen`: a decode step's rows, padding sequences among them, through the tiles a step with prompt
        # rows gives them (benchmarks/decode_attention.py times both ways)
        chunks = [(100, 1, list(range(0, 7))), (200, 1, list(range(7, 20))), (3, 1, [30]), (0, 1, [31])]
        case = _case(chunks, 8, 2, 32, 16, 40, seed=5, pad_seqs=2)
        _check(case, tiles=tiles, varlen=True)

    @pytest.mark.parametrize("num_splits", [1, 4])
    def test_padding_sequences_read_nothing(monkeypatch, num_splits):
        # A padded decode batch: the padding sequences' rows (slot -1, seq_len 0) come back as zeros, written
        # by the kernels (a decode step's output is not zero-filled first: poison what it allocates).
        q, k, v, cache, meta = _case([(5, 1, [0, 1])], 4, 2, 16, 4, 4, seed=4, pad_seqs=3)
        monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, float("nan")))
        write_kv(cache, k, v, meta.slot_mapping)
        out = paged_attention(q, cache, meta, 0.25, num_splits=num_splits)
        assert torch.equal(out[1:], torch.zeros_like(out[1:]))
        assert out[0].abs().sum() > 0

    def test_decode_splits_are_static():
        cpu = torch.device("cpu")
        assert decode_splits(1, 4, cpu) == decode_splits(1, 4, cpu)
        assert 1 <= decode_splits(128, 4, cpu) <= decode_splits(1, 4, cpu) <= 16
