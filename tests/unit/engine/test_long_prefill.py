"""Prompt chunks over long contexts through a varlen kernel over keys gathered from their pages
(`engine/attention/long_prefill.py`): the gather, the dispatch rule, the start-up check of torch's kernel and
the memory the floor counts for it, on the CPU, with a varlen attention written plainly as the kernel's stand-in.
"""

import torch
import torch.nn.functional as F

from omnistage.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchReferenceBackend,
    gather_bytes,
    long_prefill,
)

PAGE = 4


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, aligned_at_end=True):
    """FlashAttention's varlen contract in plain torch: each sequence's rows attend causally to its keys, its
    last row seeing every key (`aligned_at_end=False`: its first row sees the first key, a kernel whose causal
    mask starts at the top left)."""
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        rows, keys = q1 - q0, k1 - k0
        mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows if aligned_at_end else 0)
        out[q0:q1] = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out


def step(chunks, pages_total=64, heads=4, kv_heads=2, dim=16, seed=0):
    """A step over `chunks` (cached, new) with each sequence's pages scattered over the pool, its K/V written:
    (q, kv_cache, meta)."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages_total, generator=generator).tolist()
    tables, at = [], 0
    for cached, new in chunks:
        count = -(-(cached + new) // PAGE)
        tables.append(order[at : at + count])
        at += count
    meta = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(chunks, tables)], PAGE)
    kv_cache = torch.randn(2, pages_total, PAGE, kv_heads, dim, generator=generator)
    rows = sum(n for _, n in chunks)
    q = torch.randn(rows, heads, dim, generator=generator)
    return q, kv_cache, meta


def test_the_keys_are_gathered_in_each_sequence_s_order():
    chunks = [(9, 3), (0, 5), (14, 1), (4, 4)]
    _, _, meta = step(chunks)
    slots, cu_keys = long_prefill.key_slots(meta, PAGE)
    expected = []
    for b, (cached, new) in enumerate(chunks):
        table = meta.block_tables[b].tolist()
        expected += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached + new)]
    assert slots.tolist() == expected
    assert cu_keys.tolist() == [0, 12, 17, 32, 40] and cu_keys.dtype == torch.int32
    assert meta.num_keys == 40


def test_a_step_through_the_gather_equals_the_paged_reference():
    # a long prompt's chunk after its cached rows, beside decode rows and a fresh prompt
    q, kv_cache, meta = step([(37, 20), (12, 1), (0, 7), (50, 1)], pages_total=40)
    gathered = long_prefill.attend(q, kv_cache, meta, 0.25, varlen)
    torch.testing.assert_close(gathered, TorchReferenceBackend().attend(q, kv_cache, meta, 0.25))
    misaligned = long_prefill.attend(q, kv_cache, meta, 0.25, lambda *a: varlen(*a, aligned_at_end=False))
    assert not torch.allclose(misaligned, gathered, atol=1e-3)  # the comparison sees a mask's alignment


def test_only_eager_prompt_chunks_over_long_contexts_take_the_gather():
    keys = long_prefill.MIN_KEYS
    rows = long_prefill.MIN_ROWS

    def meta(chunks, **pad):
        return AttentionMetadata.build([(c, n, range(-(-(c + n) // 16))) for c, n in chunks], 16, **pad)

    bf16 = torch.bfloat16
    assert long_prefill.applies(meta([(keys - rows, rows), (300, 1)]), bf16)
    assert not long_prefill.applies(meta([(keys - rows + 1, rows - 1)]), bf16)  # too few prompt rows
    assert not long_prefill.applies(meta([(keys - rows - 1, rows)]), bf16)  # too short a context
    assert not long_prefill.applies(meta([(keys, 1)] * 8), bf16)  # decode rows: the paged kernel's split-KV
    assert not long_prefill.applies(meta([(keys, rows)], pad_rows=16), bf16)  # a padded step: keys unknown
    over = long_prefill.MAX_KEYS - keys + 1
    assert not long_prefill.applies(
        meta([(keys - rows, rows), (over, 1)]), bf16
    )  # more keys than the floor counts
    # FlashAttention takes 16-bit queries only: a float32 model keeps the paged kernel
    assert long_prefill.applies(meta([(keys - rows, rows)]), torch.float16)
    assert not long_prefill.applies(meta([(keys - rows, rows)]), torch.float32)


def test_torch_s_kernel_is_taken_only_where_it_agrees_with_attention():
    assert long_prefill._agrees(varlen, torch.device("cpu"))
    assert not long_prefill._agrees(
        lambda *a: varlen(*a, aligned_at_end=False).to(torch.bfloat16), torch.device("cpu")
    )
    assert long_prefill.flash_varlen(torch.device("cpu")) is None


class Gathering(TorchReferenceBackend):
    def scratch_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return long_prefill.scratch_bytes(kv_heads, head_dim, dtype)


class Layer(torch.nn.Module):
    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend


def test_the_floor_counts_the_most_keys_a_step_gathers():
    model = torch.nn.Sequential(Layer(TorchReferenceBackend()), Layer(Gathering()))
    # the Thinker's layout: 65,536 keys of 4 K/V heads of 128 in bfloat16, K and V, and their int64 slots
    assert gather_bytes(model, 4, 128, torch.bfloat16) == 65536 * (2 * 4 * 128 * 2 + 8)
    assert gather_bytes(torch.nn.Sequential(Layer(TorchReferenceBackend())), 4, 128, torch.bfloat16) == 0
    assert gather_bytes(model, 4, 128, torch.float32) == 0  # a float32 model never gathers
