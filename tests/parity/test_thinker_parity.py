"""Our Thinker (paged KV, torch reference attention) against transformers' thinker on the same weights.

float32 on the CPU: logits within 1e-4 of max |logit|, greedy tokens identical.
"""

import pytest
import torch

from omnistage.bench.hf_layout import text_model
from omnistage.engine.attention import AttentionMetadata, Chunk, TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.thinker import Thinker, load_thinker
from omnistage.models.qwen3_omni.tiny import tiny_config, write_weights

PAGE = 4  # small, so every prompt spans several pages
NUM_PAGES = 96
TOLERANCE = 1e-4
EOS = (151645, 151643)


def variant_config() -> dict:
    """Other head counts, GQA 8:1, wider heads, other M-RoPE sections, 6 experts top-3 without renorm."""
    config = tiny_config()
    text = config["thinker_config"]["text_config"]
    text.update(
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=False,
    )
    text["rope_parameters"]["mrope_section"] = [8, 4, 4]
    return config


@pytest.fixture(scope="module", params=["tiny", "thinking", "variant"])
def models(request, tmp_path_factory):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    if request.param == "tiny":
        directory = request.getfixturevalue("tiny_checkpoint")  # the session's shared one (conftest)
    elif request.param == "thinking":  # the Thinking checkpoint: the Thinker alone, no talker.* tensors
        directory = request.getfixturevalue("tiny_thinking_checkpoint")
    else:
        directory = write_weights(tmp_path_factory.mktemp("variant") / "ckpt", variant_config(), seed=1)
    ours = load_thinker(directory, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())
    theirs = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    ).thinker.eval()
    return ours, theirs


def prompts(count: int, seed: int, lengths=(11, 5, 17, 2, 9)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [151644, 872]
        + torch.randint(0, 151643, (lengths[i % len(lengths)] - 2,), generator=generator).tolist()
        for i in range(count)
    ]


class PagedRun:
    """Drives our Thinker like the engine will: ragged batches over a shared, shuffled page pool."""

    def __init__(self, thinker: Thinker) -> None:
        cfg = thinker.config
        self.thinker = thinker
        self.kv_caches = [
            torch.zeros(2, NUM_PAGES, PAGE, cfg.num_key_value_heads, cfg.head_dim)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.free = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0)).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed new tokens per sequence id in one forward; logits `[n, vocab]` of each sequence's new tokens."""
        chunks, ids, positions = [], [], []
        for seq, tokens in feeds.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * PAGE < end:
                pages.append(self.free.pop())
            chunks.append(Chunk(start, len(tokens), pages))
            ids += tokens
            positions += range(start, end)
            self.lens[seq] = end
        meta = AttentionMetadata.build(chunks, PAGE)
        text_positions = torch.tensor(positions).expand(3, -1)  # text: all three streams equal
        hidden = self.thinker(torch.tensor(ids), text_positions, self.kv_caches, meta)
        logits = self.thinker.compute_logits(hidden).split([len(t) for t in feeds.values()])
        return dict(zip(feeds, logits, strict=True))


@torch.no_grad()
def reference_logits(theirs, tokens: list[int]) -> torch.Tensor:
    return theirs(input_ids=torch.tensor([tokens])).logits[0].float()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_prefill_logits(models):
    ours, theirs = models
    batch = prompts(5, seed=0)
    logits = PagedRun(ours).step(dict(enumerate(batch)))
    worst = max(relative_error(logits[i], reference_logits(theirs, p)) for i, p in enumerate(batch))
    print(f"prefill max relative error {worst:.2e}")
    assert worst <= TOLERANCE


def test_prefill_then_decode_logits(models):
    ours, theirs = models
    batch = prompts(4, seed=1)
    steps = 10
    generator = torch.Generator().manual_seed(2)
    continuations = [torch.randint(0, 151643, (steps,), generator=generator).tolist() for _ in batch]
    full = [p + c for p, c in zip(batch, continuations, strict=True)]
    expected = [reference_logits(theirs, tokens) for tokens in full]
    run = PagedRun(ours)
    # sequence 0 prefills in two chunks (chunked prefill), the others at once
    head = len(batch[0]) // 2
    got = run.step({0: batch[0][:head], 1: batch[1], 2: batch[2]})
    second = run.step({0: batch[0][head:], 3: batch[3]})
    got[0], got[3] = torch.cat([got[0], second[0]]), second[3]
    worst = 0.0
    for i in range(len(batch)):
        worst = max(worst, relative_error(got[i], expected[i][: len(batch[i])]))
    for step in range(steps):
        out = run.step({i: [continuations[i][step]] for i in range(len(batch))})
        for i in range(len(batch)):
            worst = max(worst, relative_error(out[i][0], expected[i][len(batch[i]) + step]))
    print(f"prefill+decode max relative error {worst:.2e}")
    assert worst <= TOLERANCE


@torch.no_grad()
def test_embeds_deepstack_and_mrope_positions(models):
    """inputs_embeds, deepstack additions and three distinct position streams, as the vision path uses them."""
    ours, theirs = models
    hidden_size = ours.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    length = 14
    embeds = torch.randn(length, hidden_size, generator=generator)
    visual = torch.zeros(length, dtype=torch.bool)
    visual[3:9] = True
    deepstack = [torch.randn(int(visual.sum()), hidden_size, generator=generator) for _ in range(2)]
    # an image grid's positions: t fixed, h and w walking the grid, text after it resuming past the max
    positions = torch.arange(length).expand(3, -1).clone()
    positions[:, 3:9] = torch.tensor([[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]])
    positions[:, 9:] = torch.arange(6, 6 + length - 9)

    ref = text_model(theirs)(
        inputs_embeds=embeds[None],
        position_ids=positions[:, None, :],
        visual_pos_masks=visual[None],
        deepstack_visual_embeds=deepstack,
    ).last_hidden_state[0]
    dense = []
    for features in deepstack:
        full = torch.zeros(length, hidden_size)
        full[visual] = features
        dense.append(full)
    run = PagedRun(ours)
    meta = AttentionMetadata.build([Chunk(0, length, run.free[:4])], PAGE)
    got = ours(torch.zeros(length, dtype=torch.long), positions, run.kv_caches, meta, embeds, dense)
    error = relative_error(got, ref)
    print(f"embeds+deepstack+mrope max relative error {error:.2e}")
    assert error <= TOLERANCE


@torch.no_grad()
def test_greedy_tokens_match_generate(models):
    ours, theirs = models
    batch = prompts(3, seed=4, lengths=(12, 7, 20))
    new_tokens = 32
    expected = []
    for tokens in batch:
        out = theirs.generate(
            input_ids=torch.tensor([tokens]),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=list(EOS),
        )
        expected.append(out[0, len(tokens) :].tolist())

    run = PagedRun(ours)
    generated: dict[int, list[int]] = {i: [] for i in range(len(batch))}
    feeds = dict(enumerate(batch))
    while feeds:
        logits = run.step(feeds)
        feeds = {}
        for i, seq_logits in logits.items():
            token = int(seq_logits[-1].argmax())
            generated[i].append(token)
            if token not in EOS and len(generated[i]) < new_tokens:
                feeds[i] = [token]
    assert [generated[i] for i in range(len(batch))] == expected
