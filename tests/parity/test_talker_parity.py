"""Our Talker (paged KV, torch reference attention) against transformers' talker on the same weights.

float32 on the CPU: projections, final hidden states and codec logits within 1e-4 of their max |value|,
for a prefill of random input embeddings at M-RoPE positions and the decode steps that follow it.
"""

import pytest
import torch
from transformers import DynamicCache

from omnistage.engine.attention import AttentionMetadata, Chunk, TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.talker import Talker, load_talker
from omnistage.models.qwen3_omni.tiny import tiny_config, write_weights

PAGE = 4  # small, so every sequence spans several pages
NUM_PAGES = 64
TOLERANCE = 1e-4


def variant_config() -> dict:
    """Another talker: 3 layers, 6 heads over 2 KV heads of 24, 6 experts top-3 without renorm, other
    M-RoPE sections, shared expert and projection widths."""
    config = tiny_config()
    text = config["talker_config"]["text_config"]
    text.update(
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=40,
        moe_intermediate_size=12,
        num_local_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        shared_expert_intermediate_size=20,
    )
    text["rope_parameters"]["mrope_section"] = [6, 3, 3]
    return config


@pytest.fixture(scope="module", params=["tiny", "variant"])
def models(request, tmp_path_factory):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    if request.param == "tiny":
        directory = request.getfixturevalue("tiny_checkpoint")  # the session's shared one (conftest)
    else:
        directory = write_weights(
            tmp_path_factory.mktemp("talker-variant") / "ckpt", variant_config(), seed=1
        )
    ours = load_talker(directory, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())
    theirs = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    ).talker.eval()
    return ours, theirs


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def mrope_positions(length: int, grid: tuple[int, int, int] | None) -> torch.Tensor:
    """Positions `[3, length]`: text on all three streams, and optionally an image-like block at row 3 with
    t fixed and h, w walking a grid, the text after it resuming past the block's largest position."""
    positions = torch.arange(length).expand(3, -1).clone()
    if grid is None:
        return positions
    t, h, w = grid
    start, size = 3, t * h * w
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    positions[:, start : start + size] = start + torch.stack([tt.flatten(), hh.flatten(), ww.flatten()])
    after = length - start - size
    resume = int(positions[:, start : start + size].max()) + 1
    positions[:, start + size :] = torch.arange(resume, resume + after)
    return positions


class PagedRun:
    """Drives our Talker like an engine stage: ragged batches of embeddings over a shuffled page pool."""

    def __init__(self, talker: Talker) -> None:
        cfg = talker.config.text
        self.talker = talker
        self.kv_caches = [
            torch.zeros(2, NUM_PAGES, PAGE, cfg.num_key_value_heads, cfg.head_dim)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.free = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0)).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(
        self, feeds: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Feed (embeddings `[n, H]`, positions `[3, n]`) per sequence id in one forward; per sequence the
        final hidden states and the codec logits of its new rows."""
        chunks = []
        for seq, (embeds, _) in feeds.items():
            start = self.lens.get(seq, 0)
            end = start + embeds.shape[0]
            pages = self.pages.setdefault(seq, [])
            while len(pages) * PAGE < end:
                pages.append(self.free.pop())
            chunks.append(Chunk(start, embeds.shape[0], pages))
            self.lens[seq] = end
        meta = AttentionMetadata.build(chunks, PAGE)
        embeds = torch.cat([e for e, _ in feeds.values()])
        positions = torch.cat([p for _, p in feeds.values()], dim=1)
        hidden = self.talker(embeds, positions, self.kv_caches, meta)
        logits = self.talker.compute_logits(hidden)
        sizes = [e.shape[0] for e, _ in feeds.values()]
        return dict(zip(feeds, zip(hidden.split(sizes), logits.split(sizes), strict=True), strict=True))


@torch.no_grad()
def test_projections_and_codec_embedding(models):
    ours, theirs = models
    generator = torch.Generator().manual_seed(0)
    thinker_rows = torch.randn(13, ours.config.thinker_hidden_size, generator=generator)
    for name in ("text_projection", "hidden_projection"):
        got = getattr(ours, name)(thinker_rows)
        assert got.shape == (13, ours.config.text.hidden_size)
        error = relative_error(got, getattr(theirs, name)(thinker_rows))
        print(f"{name} max relative error {error:.2e}")
        assert error <= TOLERANCE
    codes = torch.tensor([0, 2047, 2148, 2149, 2150, 2302, ours.config.text.vocab_size - 1])
    assert torch.equal(ours.model.codec_embedding(codes), theirs.get_input_embeddings()(codes))


@torch.no_grad()
def test_prefill_hidden_and_codec_logits(models):
    """Three sequences in one ragged step, two of them with image-like M-RoPE blocks."""
    ours, theirs = models
    generator = torch.Generator().manual_seed(1)
    hidden_size = ours.config.text.hidden_size
    shapes = [(14, (1, 2, 3)), (9, None), (17, (2, 2, 2))]
    feeds = {
        i: (torch.randn(length, hidden_size, generator=generator), mrope_positions(length, grid))
        for i, (length, grid) in enumerate(shapes)
    }
    got = PagedRun(ours).step(feeds)
    worst_hidden = worst_logits = 0.0
    for i, (embeds, positions) in feeds.items():
        ref_hidden = theirs.model(
            inputs_embeds=embeds[None], position_ids=positions[:, None, :]
        ).last_hidden_state
        ref_logits = theirs(inputs_embeds=embeds[None], position_ids=positions[:, None, :]).logits
        worst_hidden = max(worst_hidden, relative_error(got[i][0], ref_hidden[0]))
        worst_logits = max(worst_logits, relative_error(got[i][1], ref_logits[0]))
    print(f"prefill max relative error: hidden {worst_hidden:.2e}, codec logits {worst_logits:.2e}")
    assert worst_hidden <= TOLERANCE and worst_logits <= TOLERANCE


@torch.no_grad()
def test_prefill_then_decode_codec_logits(models):
    """Prefill (one sequence in two chunks), then one-token steps at position cache length + rope delta on all
    three streams, batched; transformers runs each sequence alone with its DynamicCache."""
    ours, theirs = models
    generator = torch.Generator().manual_seed(2)
    hidden_size = ours.config.text.hidden_size
    shapes = [(15, (1, 3, 2)), (6, None), (11, (1, 2, 2))]
    steps = 6
    prompts = [
        (torch.randn(length, hidden_size, generator=generator), mrope_positions(length, grid))
        for length, grid in shapes
    ]
    decode_embeds = [torch.randn(steps, hidden_size, generator=generator) for _ in shapes]

    expected = []
    for (embeds, positions), step_embeds in zip(prompts, decode_embeds, strict=True):
        cache = DynamicCache(config=theirs.config.text_config)
        out = theirs(
            inputs_embeds=embeds[None],
            position_ids=positions[:, None, :],
            past_key_values=cache,
            use_cache=True,
        )
        logits = [out.logits[0]]
        next_position = int(positions.max()) + 1
        for step in range(steps):
            position = torch.full((3, 1, 1), next_position + step)
            out = theirs(
                inputs_embeds=step_embeds[None, step : step + 1],
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                generation_step=step,
            )
            logits.append(out.logits[0])
        expected.append(logits)

    run = PagedRun(ours)
    head = 7
    (e0, p0), (e1, p1), (e2, p2) = prompts
    first = run.step({0: (e0[:head], p0[:, :head]), 1: (e1, p1)})
    second = run.step({0: (e0[head:], p0[:, head:]), 2: (e2, p2)})
    got = [[torch.cat([first[0][1], second[0][1]])], [first[1][1]], [second[2][1]]]
    for step in range(steps):
        feeds = {
            i: (decode_embeds[i][step : step + 1], torch.full((3, 1), int(prompts[i][1].max()) + 1 + step))
            for i in range(len(prompts))
        }
        for i, (_, logits) in run.step(feeds).items():
            got[i].append(logits)
    # the prefill block as a whole, each decode step's row on its own
    worst = max(
        relative_error(g, e)
        for got_seq, expected_seq in zip(got, expected, strict=True)
        for g, e in zip(got_seq, expected_seq, strict=True)
    )
    print(f"prefill+decode codec logits max relative error {worst:.2e}")
    assert worst <= TOLERANCE
