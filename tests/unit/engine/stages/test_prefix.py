"""Prefix caching on the tiny checkpoint (CPU, float32): greedy ids with the cache equal those without it, for
shared system prompts, multi-turn chats (their answers' pages too) and multimodal prompts; hits counted; the
pool full afterwards."""

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import LLM, SamplingParams
from omnistage.engine.stages.encoders import MultimodalEmbeds
from omnistage.engine.stages.prefix import request_keys
from omnistage.engine.stages.token_runner import HiddenTap
from omnistage.models.qwen3_omni.audio_features import log_mel
from omnistage.request import GenerationRequest

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = {
    "role": "system",
    "content": "You are a careful assistant. Answer briefly and cite the rule you used.",
}


def make_llm(checkpoint, **kwargs):
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=256, **kwargs)


@pytest.fixture(scope="module")
def cached(tiny_checkpoint):
    return make_llm(tiny_checkpoint)


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint):
    return make_llm(tiny_checkpoint, prefix_caching=False)


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def hits(llm):
    pool = llm.engine.pool
    return pool.queried_tokens, pool.hit_tokens


def assert_pool_full(llm):
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages and pool.num_used == 0
    assert all(pool.holders(p) == 0 for p in range(pool.num_pages))
    assert not llm.engine.has_unfinished()


def test_a_shared_system_prompt_is_prefilled_once_and_changes_no_token(cached, uncached):
    chats = [[SYSTEM, {"role": "user", "content": q}] for q in ("Hi", "What is 2+2?", "Name a colour.")]
    expected = ids(uncached.chat(chats, GREEDY))
    queried, found = hits(cached)
    assert ids(cached.chat(chats[:1], GREEDY)) == expected[:1]  # fills the cache
    assert ids(cached.chat(chats[1:], GREEDY)) == expected[1:]  # two at once over its pages
    system_tokens = len(cached.engine.processor.tokenizer.encode("You are a careful assistant.").ids)
    queried2, found2 = hits(cached)
    assert found2 - found >= 2 * system_tokens
    assert uncached.engine.pool.hit_tokens == 0 and uncached.engine.stats()["prefix_cache_queries"] == 0
    assert cached.engine.stats()["prefix_cache_hits"] == found2
    assert_pool_full(cached)


def test_a_chats_next_turn_reuses_the_pages_of_the_turn_before(cached, uncached):
    """Turn 2 is turn 1's prompt, its answer and a new message; turn 3 the same again: each prefills only what
    the turn before did not (its pages up to the last full one)."""
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    turns = []
    for new in ("And the mountains?", "Which is older?", None):
        expected = uncached.chat(messages, GREEDY)[0]
        queried, found = hits(cached)
        out = cached.chat(messages, GREEDY)[0]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        after = hits(cached)
        turns.append((len(out.prompt_token_ids), after[1] - found))
        if new is None:
            break
        messages += [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": new}]
    first, *later = turns
    assert first[1] == 0
    previous = first[0]
    for prompt_len, hit in later:
        # at least every full page of the turn before's prompt (its answer re-rendered may tokenize otherwise)
        assert hit >= previous // 4 * 4 - 4, turns
        previous = prompt_len
    print("turns (prompt tokens, tokens found cached):", turns)
    assert_pool_full(cached)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_chats_next_turn_takes_the_answers_pages_from_the_cache(cached, uncached, ahead):
    """Each turn's answer, rendered by the chat template into the next turn's prompt, is the very ids the model
    sampled (logit_bias steers the random model to whole words, which the tokenizer gives back alike) at the
    very positions: the next turn finds every full page the turn before computed cached, its answer's too,
    decoding ahead or not, and samples what it samples without the cache."""
    words = cached.engine.processor.tokenizer.encode(" one two three four five six seven eight nine ten").ids
    params = SamplingParams(
        max_tokens=14, temperature=0.0, ignore_eos=True, logit_bias=dict.fromkeys(words, 100)
    )
    cached.engine.decode_ahead = ahead
    messages = [
        {"role": "user", "content": f"{'Ahead' if ahead else 'Stepwise'}, count with me."}
    ]  # no page cached
    computed = 0  # the rows the turn before computed: its prompt and its answer but the last sampled id
    try:
        for turn in range(3):
            expected = uncached.chat(messages, params)[0]
            before = hits(cached)[1]
            out = cached.chat(messages, params)[0]
            answer = out.outputs[0]
            assert answer.token_ids == expected.outputs[0].token_ids
            assert hits(cached)[1] - before == computed // 4 * 4
            computed = len(out.prompt_token_ids) + len(answer.token_ids) - 1
            messages += [
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"{turn}?"},
            ]
            following = cached.engine.processor.process_chat(messages).token_ids
            assert following[: computed + 1] == out.prompt_token_ids + answer.token_ids
    finally:
        cached.engine.decode_ahead = True
    assert_pool_full(cached)


def picture(seed, size=(64, 64)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def image_chat(image):
    return [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    ]


def test_the_same_text_with_another_image_shares_only_what_precedes_it(cached, uncached):
    first, other = picture(1), picture(2)
    expected = [ids(uncached.chat(image_chat(im), GREEDY))[0] for im in (first, other, first)]
    image_token = cached.engine.encoders.images.token_id
    outs, found = [], []
    for im in (first, other, first):
        before = hits(cached)[1]
        outs.append(cached.chat(image_chat(im), GREEDY)[0])
        found.append(hits(cached)[1] - before)
    assert ids(outs) == expected
    prompt = outs[0].prompt_token_ids
    first_row = prompt.index(image_token)
    last_row = len(prompt) - 1 - prompt[::-1].index(image_token)
    assert found[1] <= first_row // 4 * 4  # another image: nothing from its first placeholder on
    assert found[2] > last_row  # the same image again: past all its rows
    assert_pool_full(cached)


def test_chunked_and_preempted_prefills_over_cached_pages_change_no_token(tiny_checkpoint, uncached):
    """A small pool and small steps: prompts start mid-page after their cached pages, are prefilled in
    chunks, and are preempted and readmitted onto the cache."""
    small = LLM(
        model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=14,
        max_num_batched_tokens=8,
    )  # fmt: skip
    chats = [[SYSTEM, {"role": "user", "content": f"Question number {i}?"}] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = uncached.chat(chats, params)
    assert ids(small.chat(chats[:1], params)) == ids(expected[:1])
    assert ids(small.chat(chats, params)) == ids(expected)
    queried, found = hits(small)
    prompts = sum(len(o.prompt_token_ids) for o in expected[:1] + expected)
    assert queried > prompts  # some were looked up again: preempted, and readmitted onto the cache
    assert found > 0
    assert_pool_full(small)


def test_keys_stop_before_a_tapped_row_the_runner_keeps_not(cached):
    """A prompt whose hidden rows a later stage reads (the Talker's media rows) at a layer the runner keeps no
    rows of caches only the pages before the first: a page taken from the cache would leave its rows
    unwritten. At the layer the runner keeps, every page is keyed and those the rows lie in are named: they are
    taken only where they were prefilled."""
    request = GenerationRequest("r", list(range(1, 30)), GREEDY)
    runner = cached.engine.runner
    assert runner.keep_taps and runner.tap_layer is not None
    rows = np.array([10, 11, 20])
    unkept = HiddenTap(runner.tap_layer + 1, torch.from_numpy(rows), torch.zeros(3, 2), rows)
    keys = request_keys(request, None, unkept, runner)
    assert len(keys.keys) == 2 and keys.end == 2  # pages 0-3, 4-7; page 8-11 holds row 10
    kept = HiddenTap(runner.tap_layer, torch.from_numpy(rows), torch.zeros(3, 2), rows)
    keys = request_keys(request, None, kept, runner)
    assert len(keys.keys) == 7 and keys.end is None and keys.reads_kept_rows == {2, 5}
    assert request_keys(request, None, None, runner).keys == keys.keys


def clip_rows(llm, features):
    """A clip's audio rows placed after a 3-token head: its keys' MultimodalEmbeds."""
    with torch.inference_mode():
        rows = llm.engine.encoders.audio_encoder([features])[0]
    at = np.arange(3, 3 + rows.shape[0])
    empty = np.zeros(0, dtype=np.int64)
    return MultimodalEmbeds(torch.from_numpy(at), rows, torch.from_numpy(empty), None, None, at, empty)


def test_a_growing_clips_complete_windows_give_the_whole_clips_rows_and_keys(cached):
    """The audio tower attends within 8 s windows: a clip's first 9 s, cut from the whole clip's features, give
    its first window's rows bit for bit, hence the same page keys there (what a turn prefilled as its audio
    arrives reuses). The log-mel of the first 9 s alone differs while a louder part is still to come: its -8
    floor follows its own maximum."""
    rng = np.random.default_rng(0)
    envelope = 1 + np.sin(2 * np.pi * 0.7 * np.arange(20 * 16000) / 16000)  # near silence at its troughs
    wave = (0.05 * rng.standard_normal(20 * 16000) * envelope).astype(np.float32)
    wave[15 * 16000 : 16 * 16000] *= 8
    whole = log_mel(wave)
    window = cached.engine.encoders.audio_encoder.cfg.n_window_infer  # frames
    rows_per_window = cached.engine.encoders.audio_encoder.output_tokens(window)
    complete, early = clip_rows(cached, whole), clip_rows(cached, whole[:, :900])
    assert torch.equal(early.audio_embeds[:rows_per_window], complete.audio_embeds[:rows_per_window])
    assert not torch.equal(early.audio_embeds[rows_per_window:], complete.audio_embeds[rows_per_window:117])

    def keys(mm):
        ids = [1, 2, 3] + [cached.engine.encoders.audio.token_id] * mm.audio_embeds.shape[0] + [4]
        return request_keys(GenerationRequest("r", ids, GREEDY), mm, None, cached.engine.runner).keys

    shared = (3 + rows_per_window) // 4  # pages that end within the first window
    assert keys(early)[:shared] == keys(complete)[:shared]
    assert keys(early)[shared] != keys(complete)[shared]
    own = log_mel(wave[: 9 * 16000])
    assert not torch.equal(own[:, :window], whole[:, :window])
