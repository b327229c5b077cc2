"""The torch reference attention backend against dense causal SDPA over each sequence's full context."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.engine.attention import AttentionMetadata, Chunk, TorchReferenceBackend

PAGE = 4


def dense_causal(q, k, v, scale):
    """q `[n, Hq, D]` are the last n of the L positions of k/v `[L, Hkv, D]`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n, length = q.shape[0], k.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def test_build_slots_and_padding():
    meta = AttentionMetadata.build([Chunk(5, 3, [7, 2]), (0, 2, [4])], PAGE, pad_seqs=1, pad_rows=2)
    assert meta.slot_mapping.tolist() == [
        2 * PAGE + 1,
        2 * PAGE + 2,
        2 * PAGE + 3,
        4 * PAGE,
        4 * PAGE + 1,
        -1,
        -1,
        -1,
    ]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert meta.seq_lens.tolist() == [8, 2, 0]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0], [0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 8)
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    with pytest.raises(ValueError, match="need 3 pages"):
        AttentionMetadata.build([(0, 9, [0, 1])], PAGE)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_ragged_batch_matches_dense(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, num_pages = 16, 24
    # (cached, new) per sequence: chunked prefill, fresh prefill, decodes, a chunk ending on a page edge
    shapes = [(5, 3), (0, 7), (9, 1), (0, 1), (4, 4), (13, 1)]
    pages = torch.randperm(num_pages, generator=gen).tolist()
    tables = []
    for cached, new in shapes:
        need = -(-(cached + new) // PAGE)
        tables.append(pages[:need])
        pages = pages[need:]
    ks = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in shapes]
    vs = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in shapes]
    qs = [torch.randn(n, heads, dim, generator=gen) for _, n in shapes]
    cache = torch.zeros(2, num_pages, PAGE, kv_heads, dim)
    backend, scale = TorchReferenceBackend(), dim**-0.5

    # step 1: the cached parts, as one ragged prefill batch (its outputs are checked too)
    cached = [i for i, (c, _) in enumerate(shapes) if c]
    meta = AttentionMetadata.build([(0, shapes[i][0], tables[i]) for i in cached], PAGE)
    q1 = torch.randn(sum(shapes[i][0] for i in cached), heads, dim, generator=gen)
    k1 = torch.cat([ks[i][: shapes[i][0]] for i in cached])
    v1 = torch.cat([vs[i][: shapes[i][0]] for i in cached])
    out1 = backend.forward(q1, k1, v1, cache, meta, scale)
    row = 0
    for i in cached:
        c = shapes[i][0]
        torch.testing.assert_close(
            out1[row : row + c], dense_causal(q1[row : row + c], ks[i][:c], vs[i][:c], scale)
        )
        row += c

    # step 2: every sequence's new tokens in one batch, plus a padding sequence and padding rows
    meta = AttentionMetadata.build(
        [(c, n, t) for (c, n), t in zip(shapes, tables, strict=True)], PAGE, pad_seqs=1, pad_rows=3
    )
    pad = 4
    q2 = torch.cat(qs + [torch.randn(pad, heads, dim, generator=gen)])
    k2 = torch.cat(
        [k[c:] for k, (c, _) in zip(ks, shapes, strict=True)]
        + [torch.randn(pad, kv_heads, dim, generator=gen)]
    )
    v2 = torch.cat(
        [v[c:] for v, (c, _) in zip(vs, shapes, strict=True)]
        + [torch.randn(pad, kv_heads, dim, generator=gen)]
    )
    before = cache.clone()
    out2 = backend.forward(q2, k2, v2, cache, meta, scale)
    row = 0
    for i, (_, n) in enumerate(shapes):
        torch.testing.assert_close(out2[row : row + n], dense_causal(qs[i], ks[i], vs[i], scale))
        row += n
    assert out2[row:].abs().max() == 0, "padding rows must read zeros"
    # padding wrote nothing: only the slots of real new tokens changed
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    untouched = torch.ones(num_pages * PAGE, dtype=torch.bool)
    untouched[written] = False
    flat_before, flat_after = before.view(2, -1, kv_heads, dim), cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat_before[:, untouched], flat_after[:, untouched])


def test_cache_dtype_differs_from_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 8, generator=gen) for h in (2, 1, 1))
    cache = torch.zeros(2, 3, PAGE, 1, 8, dtype=torch.float64)
    meta = AttentionMetadata.build([(0, 6, [2, 0])], PAGE)
    out = TorchReferenceBackend().forward(q, k, v, cache, meta, 8**-0.5)
    torch.testing.assert_close(out, dense_causal(q, k, v, 8**-0.5))


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any aten op produces while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


@pytest.mark.parametrize("cached", [0, 3584])
def test_long_context_never_materialises_every_heads_scores(cached):
    """A 512-token chunk over a 4k context runs SDPA's fused kernel: no op makes the [heads, queries, keys]
    score tensor that the unfused path writes and reads back (it made a 60k-token prompt take 200 s on the
    CPU). Counted in elements, not timed, so a busy machine cannot flake it."""
    heads, kv_heads, dim, new = 4, 2, 16, 512
    seq_len = cached + new
    kv_cache = torch.zeros(2, seq_len // PAGE, PAGE, kv_heads, dim)
    meta = AttentionMetadata.build([(cached, new, list(range(seq_len // PAGE)))], PAGE)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(new, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    with _LargestTensor() as largest:
        TorchReferenceBackend().forward(q, k, v, kv_cache, meta, dim**-0.5)
    assert largest.numel < heads * new * seq_len
