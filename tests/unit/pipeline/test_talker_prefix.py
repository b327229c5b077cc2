"""The Talker's prefix cache on the tiny checkpoint (CPU, float32): a voice conversation's next turn takes the
Talker's pages of its earlier user turns from the Talker's pool and speaks the codes it speaks without the
cache; aborted and preempted Talkers leave every page free or evictable; `prefix_caching: false` turns it off
with the Thinker's. The keys themselves (talker_prefix.py): a turn's are the previous turn's and more, and they
follow the rows' sources (ids, positions, the Thinker's hidden states at media rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omnistage import LLM, SamplingParams
from omnistage.engine.memory.plan import GiB
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker_input import SpeechTokens, user_turn_mask
from omnistage.pipeline.talker_prefix import talker_keys
from omnistage.request import SpeechParams, talker_sampling_defaults
from omnistage.server.metrics import ServerMetrics

PAGE = 4
TEXT = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def make_llm(checkpoint, **kwargs) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", page_size=PAGE, num_kv_pages=160, **kwargs)


@pytest.fixture(scope="module")
def cached(tiny_checkpoint):
    return make_llm(tiny_checkpoint)


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint):
    return make_llm(tiny_checkpoint, prefix_caching=False)


def clip(seconds: float, pitch: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)


def user_turn(i: int) -> dict:
    """A spoken user turn: a clip, with a few words after the first."""
    content: list[dict] = [{"type": "audio", "audio": clip(0.4 + 0.1 * i, 190.0 * (i + 1))}]
    if i:
        content.append({"type": "text", "text": f"and {i}"})
    return {"role": "user", "content": content}


def speaking(llm: LLM, request_id: str, messages: list[dict], frames: int = 4) -> NewRequest:
    """A spoken reply of `frames` frames from a greedy Thinker and a greedy Talker."""
    prompt = llm.pipeline.processor.process_chat(messages)
    fields = vars(talker_sampling_defaults()) | {
        "max_tokens": frames,
        "min_tokens": frames,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    speech = SpeechParams("ethan", SamplingParams(**fields))
    return NewRequest(request_id, prompt.token_ids, TEXT, prompt.prompt, prompt.mrope, prompt.mm, speech)


def run(llm: LLM, new: list[NewRequest]) -> dict[str, object]:
    """Each request's final output, stepping the pipeline until all have finished."""
    pipeline = llm.pipeline
    assert pipeline.add_requests(new) == [None] * len(new)
    final = {}
    while pipeline.has_unfinished():
        for out in pipeline.step():
            if out.finished:
                assert out.error is None, out.error
                final[out.request_id] = out
    return final


def user_rows(llm: LLM, messages: list[dict]) -> int:
    """The rows of the Talker prompt's user part: every user turn's tokens."""
    ids = torch.tensor(llm.pipeline.processor.process_chat(messages).token_ids)
    return int(user_turn_mask(ids, llm.pipeline.speech_stages.tokens).sum())


def talker_pool(llm: LLM):
    return llm.pipeline.speech_stages.talker_stage.pool


def assert_talker_pages_free(llm: LLM) -> None:
    """Every Talker page is free or cached-and-evictable: none is held."""
    pool = talker_pool(llm)
    assert not llm.pipeline.has_unfinished()
    assert pool.num_used == 0 and pool.num_free == pool.num_pages
    assert all(pool.holders(p) == 0 for p in range(pool.num_pages))
    assert llm.pipeline.thinker.pool.num_used == 0


def test_a_voice_conversations_talker_takes_its_earlier_user_turns_from_its_cache(cached, uncached):
    """Three spoken turns: each says the codes (and audio) it says without the caches, and its Talker finds
    every full page of the turn before's user part cached, so its prefill is its new user turn and the 9
    assistant rows, not the whole conversation again."""
    pool = talker_pool(cached)
    messages: list[dict] = []
    found, previous_user = [], 0
    for turn in range(3):
        messages.append(user_turn(turn))
        expected = run(uncached, [speaking(uncached, f"u{turn}", messages)])[f"u{turn}"]
        before = pool.hit_tokens
        out = run(cached, [speaking(cached, f"c{turn}", messages)])[f"c{turn}"]
        found.append(pool.hit_tokens - before)
        assert out.audio_codes == expected.audio_codes and len(out.audio_codes) == 4
        np.testing.assert_array_equal(out.audio, expected.audio)
        assert found[turn] == previous_user // PAGE * PAGE, (turn, found, previous_user)
        previous_user = user_rows(cached, messages)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    assert found[0] == 0 and 0 < found[1] < found[2]
    stats = cached.pipeline.stats()
    assert stats["talker_prefix_cache_hits"] == pool.hit_tokens >= sum(found)
    scraped = {
        s.name: s.value
        for family in text_string_to_metric_families(ServerMetrics().render(stats).decode())
        for s in family.samples
    }
    assert scraped["omnistage_talker_prefix_cache_hits_total"] == pool.hit_tokens
    assert scraped["omnistage_talker_prefix_cache_queries_total"] == pool.queried_tokens
    # off for both stages: nothing looked up, nothing cached
    off = uncached.pipeline.stats()
    assert off["prefix_cache_queries"] == off["talker_prefix_cache_queries"] == 0
    assert talker_pool(uncached).num_cached == uncached.pipeline.thinker.pool.num_cached == 0
    assert_talker_pages_free(cached)
    assert_talker_pages_free(uncached)


def test_a_turn_aborted_while_speaking_leaves_the_talkers_pages_free_or_evictable(cached, uncached):
    """Turn 2's Talker, holding its cached pages of turn 1, is aborted mid-reply: every page is let go, the
    cached ones stay cached, and the turn asked again takes them and says what it says without the cache."""
    pool, stage = talker_pool(cached), cached.pipeline.speech_stages.talker_stage
    messages = [user_turn(4)]
    first = run(cached, [speaking(cached, "a0", messages)])["a0"]
    messages += [{"role": "assistant", "content": first.outputs[0].text}, user_turn(5)]
    pipeline = cached.pipeline
    before = pool.hit_tokens
    assert pipeline.add_requests([speaking(cached, "a1", messages, frames=6)]) == [None]
    for _ in range(100):
        pipeline.step()
        seq = stage.scheduler.get("a1")
        if seq is not None and seq.num_output_tokens >= 2:
            break
    assert seq is not None and seq.num_output_tokens >= 2 and seq.num_cached_pages > 0
    assert pool.hit_tokens - before == user_rows(cached, messages[:1]) // PAGE * PAGE
    pipeline.abort("a1")
    while pipeline.has_unfinished():
        pipeline.step()
    assert_talker_pages_free(cached)
    cached_pages = pool.num_cached
    assert cached_pages > 0
    before = pool.hit_tokens
    again = run(cached, [speaking(cached, "a2", messages, frames=6)])["a2"]
    assert pool.hit_tokens - before == user_rows(cached, messages) // PAGE * PAGE
    assert (
        again.audio_codes == run(uncached, [speaking(uncached, "b2", messages, frames=6)])["b2"].audio_codes
    )
    assert_talker_pages_free(cached)


def test_talkers_preempted_over_shared_pages_speak_as_alone(tiny_checkpoint, uncached):
    """A Talker pool of 20 pages for two Talkers of ~14 pages each over the same two user turns: the newer is
    preempted, readmitted onto the pages the older holds, and both say what they say alone; afterwards every
    page is free or evictable."""
    text = uncached.pipeline.model_config.talker.text
    small = make_llm(
        tiny_checkpoint, stages={"talker": {"kv_cache_memory_gib": 20 * PAGE * text.kv_bytes_per_token / GiB}}
    )
    pool, stage = talker_pool(small), small.pipeline.speech_stages.talker_stage
    assert pool.num_pages == 20
    messages = [user_turn(6), {"role": "assistant", "content": "Yes."}, user_turn(7)]
    alone = run(uncached, [speaking(uncached, "alone", messages, frames=20)])["alone"]
    preempted: list[str] = []
    original = stage.scheduler._preempt
    stage.scheduler._preempt = lambda seq: preempted.append(seq.request_id) or original(seq)
    together = run(small, [speaking(small, f"t{i}", messages, frames=20) for i in range(2)])
    assert preempted and pool.hit_tokens > 0
    for out in together.values():
        assert out.audio_codes == alone.audio_codes
    assert_talker_pages_free(small)


@pytest.fixture(scope="module")
def tokens(tiny_checkpoint) -> SpeechTokens:
    return SpeechTokens.from_config(Qwen3OmniConfig.from_dir(tiny_checkpoint))


def chat_ids(tokens: SpeechTokens, turns: list[list[int]]) -> list[int]:
    """User turns of the given contents with a one-token answer between them, ending in the assistant header."""
    nl, im_end, answer = 198, 151645, 9454
    ids: list[int] = []
    for i, content in enumerate(turns):
        if i:
            ids += [tokens.im_start, tokens.assistant, nl, answer, im_end, nl]
        ids += [tokens.im_start, tokens.user, nl, *content, im_end, nl]
    return ids + [tokens.im_start, tokens.assistant, nl]


def keys_of(tokens: SpeechTokens, ids: list[int], accept: torch.Tensor, shift: int = 0) -> list[bytes]:
    """The keys of a prompt whose Thinker hidden states are `accept` `[P, H]` (the rows at its placeholders
    are what the Talker reads)."""
    user = int(user_turn_mask(torch.tensor(ids), tokens).sum())
    positions = PromptPositions(torch.arange(shift, shift + user + 9).expand(3, -1), shift)
    media = torch.isin(torch.tensor(ids), torch.tensor(tokens.placeholders))
    return talker_keys(ids, tokens, accept[media], positions, PAGE).keys


def test_a_turns_keys_extend_the_turn_befores_and_follow_the_rows_sources(tokens):
    audio = tokens.placeholders[0]
    turn1, turn2 = [audio] * 7 + [11, 12], [audio] * 5 + [13]
    one, two = chat_ids(tokens, [turn1]), chat_ids(tokens, [turn1, turn2])
    hidden = torch.randn(len(two), 8)
    # the Thinker's rows of turn 1 are where they were: its prompt is turn 2's prefix
    keys1, keys2 = keys_of(tokens, one, hidden[: len(one)]), keys_of(tokens, two, hidden)
    user1 = len(turn1) + 5
    assert len(keys1) == user1 // PAGE and len(keys2) == (user1 + len(turn2) + 5) // PAGE
    assert keys2[: len(keys1)] == keys1
    # another hidden state at a media row changes its page's key and every later one, not the earlier ones
    other = hidden.clone()
    row = 3 + 5  # turn 1's sixth audio row: the Talker's row 8, on its page 2
    other[row, 0] += 1.0
    changed = keys_of(tokens, two, other)
    assert changed[:2] == keys2[:2] and all(a != b for a, b in zip(changed[2:], keys2[2:]))
    # a hidden state at a text row is not read: nothing changes
    text_row = hidden.clone()
    text_row[1, 0] += 1.0
    assert keys_of(tokens, two, text_row) == keys2
    # the same rows at other positions are other pages
    assert keys_of(tokens, two, hidden, shift=1)[0] != keys2[0]
