"""The GPU fast paths against their references: Triton paged attention, grouped-GEMM MoE, decode graphs."""

import pytest
import torch

from omnistage.engine.attention import AttentionMetadata, TorchReferenceBackend
from omnistage.engine.buckets import decode_buckets
from omnistage.models.layers.moe_experts import fused_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _attention_case(chunks, heads, kv_heads, dim, page_size, num_pages, seed, **pad):
    g = torch.Generator(device=DEV).manual_seed(seed)
    meta = AttentionMetadata.build(chunks, page_size, device=DEV, **pad)
    rows = meta.slot_mapping.shape[0]

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=DEV, dtype=torch.bfloat16)

    cache = rand(2, num_pages, page_size, kv_heads, dim)
    return rand(rows, heads, dim), rand(rows, kv_heads, dim), rand(rows, kv_heads, dim), cache, meta


def _compare_backends(case, **kwargs):
    from omnistage.engine.attention.cuda import CudaAttentionBackend
    from omnistage.kernels.attention import paged_attention, write_kv

    q, k, v, cache, meta = case
    scale = q.shape[-1] ** -0.5
    ref_cache = cache.clone()
    want = TorchReferenceBackend().forward(q, k, v, ref_cache, meta, scale)
    got_cache = cache.clone()
    got = CudaAttentionBackend().forward(q, k, v, got_cache, meta, scale)
    assert torch.equal(got_cache, ref_cache)
    assert not got.isnan().any()
    assert _rel(got, want) < 1e-2
    if kwargs:
        write_kv(cache, k, v, meta.slot_mapping)
        assert _rel(paged_attention(q, cache, meta, scale, **kwargs), want) < 1e-2
    return got


def test_ragged_prefill_bf16():
    # Thinker sizes: 32 query heads over 4 KV heads, head_dim 128, 16-token pages.
    pages = torch.randperm(256).tolist()
    chunks = [(0, 300, pages[:19]), (37, 90, pages[19:28]), (500, 129, pages[28:68]), (12, 1, pages[68:70])]
    _compare_backends(_attention_case(chunks, 32, 4, 128, 16, 256, seed=0, pad_rows=5))


def test_decode_rows_beside_prompts_padded_as_a_prefill_graph_bf16():
    # Qwen3-ASR sizes (16 q / 8 KV heads) in its loaded step: 125 decode rows beside three 75-token prompts,
    # padded to a 512-row bucket of 128 sequence slots (the programs are tiles numbered across sequences).
    import dataclasses

    chunks, page = [], 0
    for cached, new in [(80 + (37 * i) % 120, 1) for i in range(125)] + [(0, 75), (5, 75), (30, 75)]:
        pages = -(-(cached + new) // 16)
        chunks.append((cached, new, list(range(page, page + pages))))
        page += pages
    q, k, v, cache, meta = _attention_case(chunks, 16, 8, 128, 16, page, seed=4, pad_rows=512 - 350)
    empty = 128 - len(chunks)
    padded = dataclasses.replace(
        meta,
        query_start_loc=torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].expand(empty)]),
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(empty)]),
        block_tables=torch.cat(
            [meta.block_tables, meta.block_tables.new_zeros(empty, meta.block_tables.shape[1])]
        ),
        max_query_len=512,
    )
    out = _compare_backends((q, k, v, cache, padded))
    assert torch.equal(out[350:], torch.zeros_like(out[350:]))


@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
def test_decode_bf16(num_splits):
    pages = torch.randperm(512).tolist()
    lens = [1, 17, 255, 2048, 3000, 64]
    chunks, used = [], 0
    for n in lens:
        need = -(-n // 16)
        chunks.append((n - 1, 1, pages[used : used + need]))
        used += need
    case = _attention_case(chunks, 32, 4, 128, 16, 512, seed=1, pad_seqs=3)
    out = _compare_backends(case, num_splits=num_splits) if num_splits else _compare_backends(case)
    assert torch.equal(out[len(lens) :], torch.zeros_like(out[len(lens) :]))


def test_talker_and_asr_shapes_bf16():
    # Talker: 16 q / 2 KV heads; code predictor: 16 q / 8 KV heads; 128-token pages.
    for heads, kv_heads in ((16, 2), (16, 8)):
        chunks = [(0, 40, [3]), (200, 1, [0, 1]), (100, 60, [5, 6])]
        _compare_backends(_attention_case(chunks, heads, kv_heads, 128, 128, 8, seed=heads + kv_heads))


def test_grouped_moe_matches_loop_bf16():
    from omnistage.models.layers.grouped_moe import grouped_experts

    g = torch.Generator(device=DEV).manual_seed(0)
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=DEV) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=DEV) / inter**0.5).bfloat16()
    for tokens in (1, 7, 256):
        x = torch.randn(tokens, hidden, generator=g, device=DEV).bfloat16()
        probs = torch.randn(tokens, experts, generator=g, device=DEV).softmax(-1)
        weights, ids = probs.topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        got = grouped_experts(x, w13, w2, weights, ids)
        assert got.dtype == torch.bfloat16
        assert _rel(got, fused_experts(x, w13, w2, weights, ids)) < 2e-2


class SmallDecoder:
    """Embedding → attention over paged KV (Triton backend) → top-2 MoE (grouped GEMM) → logits."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        from omnistage.engine.attention.cuda import CudaAttentionBackend

        g = torch.Generator(device=DEV).manual_seed(0)
        self.heads, self.kv_heads, self.dim, hidden = 8, 2, 64, 256

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=DEV) * scale).bfloat16()

        self.embed = rand(100, hidden)
        self.wq = rand(hidden, self.heads * self.dim, scale=hidden**-0.5)
        self.wkv = rand(hidden, 2 * self.kv_heads * self.dim, scale=hidden**-0.5)
        self.wo = rand(self.heads * self.dim, hidden, scale=(self.heads * self.dim) ** -0.5)
        self.router = rand(hidden, 8, scale=hidden**-0.5)
        self.w13 = rand(8, 2 * 128, hidden, scale=hidden**-0.5)
        self.w2 = rand(8, hidden, 128, scale=128**-0.5)
        self.kv_cache = rand(2, num_pages, page_size, self.kv_heads, self.dim)
        self.backend = CudaAttentionBackend()

    def __call__(self, input_ids, positions, meta):
        from omnistage.models.layers.grouped_moe import grouped_experts

        x = self.embed[input_ids] + (positions[0, :, None] % 7).to(torch.bfloat16) / 10
        # Routed on the exact embedding: bf16 GEMMs at the padded batch may round differently, and a
        # routing flip on a near tie would be a false alarm.
        weights, ids = (x.float() @ self.router.float()).softmax(-1).topk(2, dim=-1)
        q = (x @ self.wq).view(-1, self.heads, self.dim)
        k, v = (x @ self.wkv).view(-1, 2, self.kv_heads, self.dim).unbind(1)
        x = x + self.backend.forward(q, k, v, self.kv_cache, meta, self.dim**-0.5).flatten(1) @ self.wo
        x = x + grouped_experts(x, self.w13, self.w2, weights / weights.sum(-1, keepdim=True), ids)
        return (x @ self.embed.T).float()


def test_graph_replay_equals_eager_for_every_bucket():
    from omnistage.engine.graphs import DecodeGraphs

    page_size, max_pages, max_batch = 16, 8, 64
    over = max_batch + 3  # one eager batch above the largest bucket
    num_pages = over * max_pages
    model_graph = SmallDecoder(num_pages, page_size)
    model_eager = SmallDecoder(num_pages, page_size)
    runner = DecodeGraphs(model_graph, max_batch, max_pages, max_pages * page_size, DEV)
    buckets = runner.capture(decode_buckets(max_batch))
    assert buckets == decode_buckets(max_batch) and set(runner.graph_bytes) == set(buckets)
    g = torch.Generator().manual_seed(0)
    for batch in sorted({b for b in buckets} | {b - 1 for b in buckets if b > 1} | {over}):
        lens = torch.randint(1, max_pages * page_size, (batch,), generator=g).tolist()
        chunks = [(n - 1, 1, list(range(i * max_pages, (i + 1) * max_pages))) for i, n in enumerate(lens)]
        meta = AttentionMetadata.build(chunks, page_size, device=DEV)
        input_ids = torch.randint(0, 100, (batch,), generator=g).to(DEV)
        positions = torch.tensor(lens, device=DEV).sub(1).expand(3, batch).contiguous()
        got = runner.run(input_ids, positions, meta).clone()
        want = model_eager(input_ids, positions, meta)
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-2, f"batch {batch}"
        # The same slots were written and no others (GEMMs at the padded batch may round differently).
        flat_graph, flat_eager = model_graph.kv_cache.flatten(1, 2), model_eager.kv_cache.flatten(1, 2)
        slots = meta.slot_mapping
        assert _rel(flat_graph[:, slots], flat_eager[:, slots]) < 1e-2, f"batch {batch}"
        assert (flat_graph.float() - flat_eager.float()).abs().max() < 0.25, f"batch {batch}"
