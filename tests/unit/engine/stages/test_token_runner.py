"""A step's host-built inputs: token ids, M-RoPE positions, attention metadata and the rows sampled."""

import numpy as np
import pytest
import torch

from omnistage.engine.scheduler import ScheduledChunk
from omnistage.engine.sequence import PromptInputs, Sequence
from omnistage.engine.stages.token_runner import TokenRunner, positions_for, rows_within, warm_up_shapes
from omnistage.kernels.moe_bounds import ALIGN_KERNEL_MAX_PAIRS, TALL_TILES_FROM, TILE_SWITCHES
from omnistage.models.layers.attention_metadata import AttentionMetadata
from omnistage.models.layers.rotary import PromptPositions

PAGE = 4


def sequence(prompt_len: int, outputs: int, mrope: PromptPositions | None, first_page: int) -> Sequence:
    seq = Sequence(f"r{first_page}", list(range(100, 100 + prompt_len)), 8, data=PromptInputs(mrope=mrope))
    seq.output_token_ids = list(range(500, 500 + outputs))
    seq.page_ids = list(range(first_page, first_page + -(-seq.num_tokens // PAGE)))
    return seq


def image_positions(prompt_len: int, delta: int) -> PromptPositions:
    """Positions that differ between the three streams, as an image's do."""
    return PromptPositions(torch.arange(3 * prompt_len).view(3, prompt_len) % 7, delta)


def test_prepare_lays_out_every_kind_of_chunk():
    chunks = [
        ScheduledChunk(sequence(6, 0, image_positions(6, -2), 0), 2, 3),  # inside an image prompt: no sample
        ScheduledChunk(sequence(6, 2, image_positions(6, -2), 10), 7, 1),  # decoding past an image prompt
        ScheduledChunk(sequence(5, 0, None, 20), 0, 5),  # a whole text prompt
        ScheduledChunk(sequence(4, 2, image_positions(4, 3), 30), 2, 4),  # the prompt's end and the outputs
        ScheduledChunk(sequence(3, 4, None, 40), 6, 1),  # text decode
    ]
    runner = TokenRunner(None, None, PAGE, torch.device("cpu"), torch.float32)
    ids, positions, meta, sample_rows = runner.prepare(chunks)

    assert ids.tolist() == [t for c in chunks for t in c.seq.all_token_ids[c.start : c.start + c.num_tokens]]
    assert ids.dtype == positions.dtype == sample_rows.dtype == torch.int64
    expected = torch.cat([positions_for(c.start, c.num_tokens, c.seq.data.mrope) for c in chunks], dim=1)
    assert torch.equal(positions, expected)
    assert sample_rows.tolist() == [3, 8, 12, 13]  # the last row of each chunk that samples
    reference = AttentionMetadata.build([(c.start, c.num_tokens, c.seq.page_ids) for c in chunks], PAGE)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(meta, name), getattr(reference, name)), name
    assert (meta.max_query_len, meta.max_seq_len) == (reference.max_query_len, reference.max_seq_len)


def _moe_path(tokens: int, experts: int, top_k: int) -> tuple[bool, int, bool]:
    """Which code a compiled MoE layer runs for a step of `tokens` rows: what moe.py (the Triton experts' tile
    class) and moe_align.py branch on, and dynamo's 0/1 specialisation of one row."""
    pairs = tokens * top_k
    per_expert = pairs / experts
    tiles = sum(per_expert > bound for bound in TILE_SWITCHES) + (per_expert >= TALL_TILES_FROM)
    return tokens == 1, tiles, pairs <= ALIGN_KERNEL_MAX_PAIRS


@pytest.mark.parametrize("routing", [(128, 6), (128, 8), (64, 4)])  # the Talker's, the Thinker's, another
@pytest.mark.parametrize("max_tokens", [512, 2048, 8192])
def test_the_warm_up_runs_every_moe_path_a_step_can_take(routing: tuple[int, int], max_tokens: int) -> None:
    shapes = warm_up_shapes(max_tokens, routing)
    warmed = {_moe_path(tokens, *routing) for tokens, _ in shapes}
    reachable = {_moe_path(tokens, *routing) for tokens in range(1, max_tokens + 1)}
    assert warmed == reachable
    # the Talker's prefill of 32 prompts that built a variant mid-serving on the H200 (838 rows, top-k 6)
    assert _moe_path(838, 128, 6) in {
        _moe_path(tokens, 128, 6) for tokens, _ in warm_up_shapes(2048, (128, 6))
    }
    assert max(tokens for tokens, _ in shapes) == max_tokens
    # a video's prefill chunks of 8,192 rows take the tall tiles, which the largest step warms
    if max_tokens == 8192:
        assert _moe_path(8192, *routing)[1] == len(TILE_SWITCHES) + 1


def test_a_dense_decoder_warms_the_common_shapes_up_to_its_budget() -> None:
    shapes = warm_up_shapes(100, None)
    assert (2, 1) in shapes and (65, 1) in shapes and (72, 8) in shapes and (100, 1) in shapes
    assert all(tokens <= 100 for tokens, _ in shapes)


def test_rows_within_finds_a_chunks_share_of_the_media_rows() -> None:
    rows = np.array([3, 4, 5, 9, 10, 20])
    for start, end in [(0, 3), (0, 4), (4, 10), (5, 21), (11, 20), (20, 21), (21, 30), (0, 100)]:
        want = [r for r in rows.tolist() if start <= r < end]
        assert rows[rows_within(rows, start, end)].tolist() == want


def test_the_warm_up_warms_each_attention_backend_once_a_layout() -> None:
    # a Thinker-like decoder's layers share one backend and one layout; a second backend (the Talker's, in its
    # own stage) and a second layout each warm once more
    from types import SimpleNamespace

    from omnistage.engine.attention import TorchReferenceBackend
    from omnistage.engine.stages.decoder import warm_attention
    from omnistage.models.layers.attention import PagedSelfAttention

    class Recording(TorchReferenceBackend):
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def warm_up(self, *layout) -> None:
            self.calls.append(layout)

    def sizes(heads: int, kv_heads: int) -> SimpleNamespace:
        return SimpleNamespace(
            hidden_size=32,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=8,
            rms_norm_eps=1e-6,
        )

    first, second = Recording(), Recording()
    decoder = torch.nn.ModuleList(
        [PagedSelfAttention(sizes(4, 2), first) for _ in range(3)]
        + [PagedSelfAttention(sizes(8, 2), first), PagedSelfAttention(sizes(4, 2), second)]
    )
    warm_attention(decoder, torch.bfloat16, torch.device("cpu"))
    cpu = torch.device("cpu")
    assert first.calls == [(4, 2, 8, torch.bfloat16, cpu), (8, 2, 8, torch.bfloat16, cpu)]
    assert second.calls == [(4, 2, 8, torch.bfloat16, cpu)]
