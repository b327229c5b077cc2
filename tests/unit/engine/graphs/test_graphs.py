"""The graph runners' padding and bucket logic, on the CPU (capture binds eager calls there)."""

import torch

from omnistage.engine.attention import AttentionMetadata, TorchReferenceBackend
from omnistage.engine.buckets import decode_buckets, prefill_buckets
from omnistage.engine.graphs import DecodeGraphs, PrefillGraphs
from omnistage.engine.graphs.decode import StaticDecodeBuffers
from omnistage.engine.graphs.prefill import StaticPrefillBuffers

PAGE, PAGES, HEADS, KV_HEADS, DIM = 4, 80, 4, 2, 8


class TinyStep:
    """Embedding, one attention layer over a paged cache, a head: enough to see padding mistakes."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(50, HEADS * DIM, generator=g)
        self.wq = torch.randn(HEADS * DIM, HEADS * DIM, generator=g) / 8
        self.wkv = torch.randn(HEADS * DIM, 2 * KV_HEADS * DIM, generator=g) / 8
        self.kv_cache = torch.randn(2, PAGES, PAGE, KV_HEADS, DIM, generator=g)
        self.backend = TorchReferenceBackend()
        self.calls: list[int] = []

    def __call__(self, input_ids, positions, meta):
        return self.forward(self.embed[input_ids], positions, meta)

    def forward(self, embeds, positions, meta):
        """Logits and the layer's input, per row."""
        self.calls.append(embeds.shape[0])
        x = embeds + positions.sum(0, keepdim=True).T.float() / 100
        q = (x @ self.wq).view(-1, HEADS, DIM)
        k, v = (x @ self.wkv).view(-1, 2, KV_HEADS, DIM).unbind(1)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, DIM**-0.5)
        return out.flatten(1) @ self.embed.T, x


def _decode_batch(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for b in range(batch):
        start = int(torch.randint(0, 11, (1,), generator=g))
        pages = [(b * 3 + i) % PAGES for i in range(3)]
        chunks.append((start, 1, pages))
    meta = AttentionMetadata.build(chunks, PAGE)
    input_ids = torch.randint(0, 50, (batch,), generator=g)
    positions = torch.stack([torch.tensor([c[0] for c in chunks])] * 3)
    return input_ids, positions, meta


def test_fill_pads_rows():
    bufs = StaticDecodeBuffers(max_batch=8, max_pages=5, max_seq_len=20, device="cpu")
    input_ids, positions, meta = _decode_batch(3, seed=0)
    bufs.inputs.fill_(7)
    bufs.slot_mapping.fill_(9)
    bufs.seq_lens.fill_(9)
    bufs.block_tables.fill_(9)
    bufs.fill(input_ids, positions, meta, bucket=4)
    m = bufs.meta(4)
    assert torch.equal(m.slot_mapping, torch.cat([meta.slot_mapping, torch.tensor([-1])]))
    assert torch.equal(m.seq_lens, torch.cat([meta.seq_lens, torch.tensor([0], dtype=torch.int32)]))
    assert torch.equal(m.query_start_loc, torch.arange(5, dtype=torch.int32))
    assert torch.equal(m.block_tables[:3, :3], meta.block_tables)
    assert (m.block_tables[:3, 3:] == 0).all() and (m.block_tables[3] == 0).all()
    assert torch.equal(bufs.inputs[:4], torch.cat([input_ids, torch.tensor([0])]))
    assert m.max_query_len == 1 and m.max_seq_len == 20
    assert bufs.inputs[4:].eq(7).all()  # rows past the bucket are not touched


def test_fill_pads_embedding_rows():
    bufs = StaticDecodeBuffers(
        max_batch=8, max_pages=5, max_seq_len=20, device="cpu", row_shape=(6,), dtype=torch.bfloat16
    )
    assert bufs.inputs.shape == (8, 6) and bufs.inputs.dtype == torch.bfloat16
    _, positions, meta = _decode_batch(3, seed=0)
    rows = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).bfloat16()
    bufs.inputs.fill_(7)
    bufs.fill(rows, positions, meta, bucket=4)
    inputs, _, m = bufs.args(4)
    assert torch.equal(inputs, torch.cat([rows, rows.new_zeros(1, 6)]))  # the padding row is a zero embedding
    assert torch.equal(m.slot_mapping, torch.cat([meta.slot_mapping, torch.tensor([-1])]))
    assert bufs.inputs[4:].eq(7).all()
    bufs.clear(4)
    assert not bufs.inputs[:4].any() and bufs.inputs[4:].eq(7).all()


def test_padded_replay_of_embedding_rows_equals_eager():
    eager_step, graph_step = TinyStep(), TinyStep()
    runner = DecodeGraphs(
        graph_step.forward, max_batch=8, max_pages=6, max_seq_len=24, device="cpu", row_shape=(HEADS * DIM,),
        dtype=torch.float32,
    )  # fmt: skip
    assert runner.capture([1, 2, 4, 8]) == [1, 2, 4, 8]
    for batch in range(1, 9):
        _, positions, meta = _decode_batch(batch, seed=batch)
        embeds = torch.randn(batch, HEADS * DIM, generator=torch.Generator().manual_seed(batch))
        logits, hidden = runner.run(embeds, positions, meta)
        want_logits, want_hidden = eager_step.forward(embeds, positions, meta)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(hidden, want_hidden)
        torch.testing.assert_close(graph_step.kv_cache, eager_step.kv_cache, rtol=1e-5, atol=1e-6)
        assert graph_step.calls[-1] == runner.bucket_for(batch)


def test_padded_replay_equals_eager_for_every_batch():
    eager_step, graph_step = TinyStep(), TinyStep()
    runner = DecodeGraphs(graph_step, max_batch=24, max_pages=6, max_seq_len=24, device="cpu")
    assert runner.capture(decode_buckets(24)) == [1, 2, 4, 8, 16, 24]
    for batch in range(1, 25):
        input_ids, positions, meta = _decode_batch(batch, seed=batch)
        logits, hidden = runner.run(input_ids, positions, meta)
        want_logits, want_hidden = eager_step(input_ids, positions, meta)
        assert logits.shape == want_logits.shape and hidden.shape == want_hidden.shape
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(hidden, want_hidden)
        # Padding rows wrote nothing to the KV cache (a padded GEMM may round the real rows' last bits
        # differently: 2.4e-7 on torch 2.13's CPU; a stray padding write would be off by O(1)).
        torch.testing.assert_close(graph_step.kv_cache, eager_step.kv_cache, rtol=1e-5, atol=1e-6)
        assert graph_step.calls[-1] == runner.bucket_for(batch)


def test_eager_fallbacks():
    step = TinyStep()
    runner = DecodeGraphs(step, max_batch=8, max_pages=6, max_seq_len=24, device="cpu")
    runner.capture([1, 2, 4])
    runner.run(*_decode_batch(6, seed=1))  # above the largest captured bucket
    assert step.calls[-1] == 6
    runner.run(*_decode_batch(3, seed=2))
    assert step.calls[-1] == 4
    # A prefill step never replays a decode graph.
    meta = AttentionMetadata.build([(0, 3, [0])], PAGE)
    runner.run(torch.tensor([1, 2, 3]), torch.zeros(3, 3, dtype=torch.long), meta)
    assert step.calls[-1] == 3


def test_enforce_eager_captures_nothing():
    step = TinyStep()
    runner = DecodeGraphs(step, max_batch=8, max_pages=6, max_seq_len=24, device="cpu", enforce_eager=True)
    assert runner.capture([1, 2, 4, 8]) == []
    assert runner.bucket_for(1) is None
    runner.run(*_decode_batch(3, seed=3))
    assert step.calls == [3]


class TinyPrefillStep(TinyStep):
    """The same layer over embeddings, returning the logits of `sample_rows` as the engine's prefill step does."""

    def __call__(self, embeds, positions, meta, sample_rows):
        logits, _ = self.forward(embeds, positions, meta)
        return logits.index_select(0, sample_rows)


def _prefill_chunk(tokens: int, start: int, seed: int):
    """One sequence's chunk and its last row, to sample."""
    g = torch.Generator().manual_seed(seed)
    pages = [(seed * 7 + i) % PAGES for i in range(-(-(start + tokens) // PAGE))]
    meta = AttentionMetadata.build([(start, tokens, pages)], PAGE)
    embeds = torch.randn(tokens, HEADS * DIM, generator=g)
    positions = torch.arange(start, start + tokens).expand(3, -1)
    return embeds, positions, meta, torch.tensor([tokens - 1])


def _mixed_step(lengths: list[int], seed: int):
    """Several sequences' chunks (a length of 1 after cached context: a decode row), each on pages of its own,
    every chunk's last row sampled but the first's (a prompt chunk that does not end its prompt)."""
    g = torch.Generator().manual_seed(seed)
    chunks, positions = [], []
    for i, tokens in enumerate(lengths):
        start = int(torch.randint(0, 9, (1,), generator=g))
        pages = [(i * 5 + p) % PAGES for p in range(-(-(start + tokens) // PAGE))]
        chunks.append((start, tokens, pages))
        positions.append(torch.arange(start, start + tokens))
    meta = AttentionMetadata.build(chunks, PAGE)
    embeds = torch.randn(sum(lengths), HEADS * DIM, generator=g)
    ends = torch.tensor(lengths).cumsum(0) - 1
    return embeds, torch.cat(positions).expand(3, -1), meta, ends[1:]


def test_prefill_replay_equals_eager_for_every_chunk_length():
    eager_step, graph_step = TinyPrefillStep(), TinyPrefillStep()
    buffers = StaticPrefillBuffers(
        max_tokens=48,
        max_pages=20,
        max_seq_len=80,
        hidden_size=HEADS * DIM,
        dtype=torch.float32,
        device="cpu",
    )
    runner = PrefillGraphs(graph_step, buffers)
    assert runner.capture(prefill_buckets(48)) == [16, 24, 32, 48]
    for tokens in range(1, 49):
        start = (tokens * 5) % 23  # chunks after cached context too
        embeds, positions, meta, last = _prefill_chunk(tokens, start, seed=tokens)
        got = runner.run(embeds, positions, meta, last)
        want = eager_step(embeds, positions, meta, last)
        assert got.shape == (1, 50)
        torch.testing.assert_close(got, want)
        # The padding rows wrote nothing: both caches hold the chunk's keys and values and nothing else
        # (a padded GEMM may round the real rows' last bits differently).
        torch.testing.assert_close(graph_step.kv_cache, eager_step.kv_cache, rtol=1e-5, atol=1e-6)
        assert (
            graph_step.calls[-1]
            == runner.bucket_for(tokens)
            == min(b for b in (16, 24, 32, 48) if b >= tokens)
        )


def test_prefill_runner_declines_what_it_cannot_hold():
    step = TinyPrefillStep()
    buffers = StaticPrefillBuffers(
        max_tokens=32,
        max_pages=4,
        max_seq_len=80,
        hidden_size=HEADS * DIM,
        dtype=torch.float32,
        device="cpu",
    )
    runner = PrefillGraphs(step, buffers)
    runner.capture([16, 32])
    assert runner.run(*_prefill_chunk(33, 0, seed=1)) is None  # longer than the largest bucket
    assert runner.run(*_prefill_chunk(8, 12, seed=2)) is None  # 20 tokens need 5 pages: wider than the table
    embeds, positions, _, last = _prefill_chunk(8, 0, seed=3)
    two = AttentionMetadata.build([(0, 4, [0]), (0, 4, [1])], PAGE)
    assert runner.run(embeds, positions, two, last) is None  # two sequences: the runner holds one
    assert step.calls == []  # nothing ran
    buffers = StaticPrefillBuffers(32, 4, 80, HEADS * DIM, torch.float32, "cpu")
    eager = PrefillGraphs(step, buffers, enforce_eager=True)
    assert eager.capture([16, 32]) == [] and eager.run(*_prefill_chunk(8, 0, seed=4)) is None


def test_a_step_of_several_sequences_replays_what_eager_computes():
    """Prompt chunks of several sequences, with decode rows beside them or alone, padded to a bucket's rows and
    sequence slots: the sampled rows' logits and the cache equal the eager step's."""
    eager_step, graph_step = TinyPrefillStep(), TinyPrefillStep()
    buffers = StaticPrefillBuffers(
        max_tokens=48, max_pages=12, max_seq_len=80, hidden_size=HEADS * DIM, dtype=torch.float32, device="cpu",
        max_seqs=6,
    )  # fmt: skip
    runner = PrefillGraphs(graph_step, buffers)
    runner.capture([16, 48])
    assert [runner.buffers.slots(b) for b in (16, 48)] == [6, 6]
    steps = [[5, 1, 1], [1, 1, 1, 1], [12, 7], [20, 1, 3, 1, 9, 1], [2], [30, 1]]
    for seed, lengths in enumerate(steps):
        embeds, positions, meta, sampled = _mixed_step(lengths, seed)
        out = runner.run(embeds, positions, meta, sampled)
        want = eager_step(embeds, positions, meta, sampled)
        # the bucket's slots, the sampled rows first (the caller takes those)
        assert out.shape == (6, 50) and graph_step.calls[-1] == runner.bucket_for(sum(lengths))
        torch.testing.assert_close(out[: len(lengths) - 1], want)
        torch.testing.assert_close(graph_step.kv_cache, eager_step.kv_cache, rtol=1e-5, atol=1e-6)
    assert runner.run(*_mixed_step([1] * 7, seed=9)) is None  # seven sequences: more than the slots
