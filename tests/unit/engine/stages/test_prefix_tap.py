"""Spoken replies over the prefix cache (tiny checkpoint, CPU, float32): the Talker reads the Thinker's hidden
states at every media row of the prompt, which the runner keeps beside the cached pages; a voice conversation's
later turns then take the earlier turns' audio from the cache and say exactly what they say without it."""

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omnistage import LLM, SamplingParams
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.request import SpeechParams, talker_sampling_defaults
from omnistage.server.metrics import ServerMetrics

PAGE = 4
TEXT = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def speaking_llm(checkpoint, **kwargs):
    return LLM(str(checkpoint), device="cpu", dtype="float32", page_size=PAGE, num_kv_pages=160, **kwargs)


@pytest.fixture(scope="module")
def cached(tiny_checkpoint):
    return speaking_llm(tiny_checkpoint)


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint):
    return speaking_llm(tiny_checkpoint, prefix_caching=False, encoder_cache_mib=0)


def clip(seconds: float, pitch: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)


def spoken_turn(i: int) -> dict:
    return {"role": "user", "content": [{"type": "audio", "audio": clip(0.4 + 0.1 * i, 220.0 * (i + 1))}]}


def speaking(llm: LLM, request_id: str, messages: list[dict]) -> NewRequest:
    prompt = llm.pipeline.processor.process_chat(messages)
    talker = SamplingParams(
        **{**vars(talker_sampling_defaults()), "max_tokens": 4, "seed": 7, "min_tokens": 4}
    )
    speech = SpeechParams("ethan", talker)
    return NewRequest(request_id, prompt.token_ids, TEXT, prompt.prompt, prompt.mrope, prompt.mm, speech)


def run(llm: LLM, new: NewRequest):
    """The request's final output, stepping the pipeline until it has finished."""
    pipeline = llm.pipeline
    assert pipeline.add_requests([new]) == [None]
    final = None
    while pipeline.has_unfinished():
        for out in pipeline.step():
            final = out if out.finished else final
    assert final is not None and final.error is None
    return final


@pytest.fixture
def taps_read(monkeypatch):
    """The tapped rows each pipeline hands the Talker, by request id (copies, as the Talker starts)."""
    seen: dict[str, torch.Tensor] = {}

    def record(llm: LLM) -> None:
        handoff = llm.pipeline.steps.handoff
        start = handoff.start_talkers

        def recording(speeches):
            for speech in speeches:
                if speech.tap is not None and speech.spoken:
                    seen[speech.request_id] = speech.tap.values.clone()
            start(speeches)

        monkeypatch.setattr(handoff, "start_talkers", recording)

    return seen, record


def samples(text: bytes) -> dict[str, float]:
    return {
        s.name: s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples
    }


def assert_pool_full(llm: LLM) -> None:
    pool = llm.pipeline.thinker.pool
    assert not llm.pipeline.has_unfinished()
    assert pool.num_free == pool.num_pages and pool.num_used == 0


def test_a_spoken_conversation_takes_its_earlier_turns_audio_from_the_cache(cached, uncached, taps_read):
    """Three spoken turns, each a new clip: their text, codec codes and audio equal those of a run without the
    caches, and so (to rounding) do the tapped rows the Talker reads. Each turn finds every full page of the
    turn before's prompt cached, its clips' rows included: the encoder cache gives an earlier clip the very
    rows it got alone (the tower's rows of a clip beside another differ in their last bits), so the pages'
    keys match, and the tower runs for the new clip only."""
    seen, record = taps_read
    record(cached)
    record(uncached)
    pool = cached.pipeline.thinker.pool
    audio_token = cached.pipeline.speech_stages.tokens.placeholders[0]
    encoders = cached.pipeline.thinker.encoders
    hits, misses = encoders.cache.hits, encoders.cache.misses
    messages: list[dict] = []
    prompts, found = [], []
    for turn in range(3):
        messages.append(spoken_turn(turn))
        before = pool.hit_tokens
        expected = run(uncached, speaking(uncached, f"u{turn}", messages))
        out = run(cached, speaking(cached, f"c{turn}", messages))
        found.append(pool.hit_tokens - before)
        prompts.append(out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert out.audio_codes == expected.audio_codes and len(out.audio_codes) == 4
        np.testing.assert_array_equal(out.audio, expected.audio)
        # a prefill from another row rounds otherwise: equal bit for bit only as the shapes happen to allow
        torch.testing.assert_close(seen[f"c{turn}"], seen[f"u{turn}"])
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    assert found[0] == 0
    for turn in (1, 2):
        assert found[turn] >= len(prompts[turn - 1]) // PAGE * PAGE, (found, [len(p) for p in prompts])
        assert prompts[turn][: found[turn]].count(audio_token) == prompts[turn - 1].count(audio_token)
    stats = cached.pipeline.stats()
    assert (stats["encoder_cache_hits"], stats["encoder_cache_misses"]) == (hits + 3, misses + 3)
    scraped = samples(ServerMetrics().render(stats))
    assert scraped["omnistage_encoder_cache_hits_total"] == stats["encoder_cache_hits"]
    assert scraped["omnistage_encoder_cache_bytes"] == stats["encoder_cache_bytes"] > 0
    assert_pool_full(cached)
    assert_pool_full(uncached)


def test_tapped_rows_read_from_the_cache_equal_those_computed(cached, uncached, taps_read):
    """The rows a prompt computes and keeps beside its pages are the rows a prompt taking those pages reads:
    the same spoken turn twice, the second time from the cache, hands the Talker the same tensor. The kept
    rows count in a page's bytes (what the memory plan sizes the pool by), and only with the cache on."""
    runner = cached.pipeline.thinker.runner
    hidden = cached.pipeline.model_config.thinker.text.hidden_size
    assert runner.keep_taps and runner.tap_rows is not None
    assert runner.tap_rows.shape == (160, PAGE, hidden)
    assert (
        not uncached.pipeline.thinker.runner.keep_taps and uncached.pipeline.thinker.runner.tap_rows is None
    )
    extra = cached.pipeline.thinker.kv_bytes_per_page - uncached.pipeline.thinker.kv_bytes_per_page
    assert extra == runner.tap_bytes_per_page == PAGE * hidden * 4  # float32
    seen, record = taps_read
    record(cached)
    pool = cached.pipeline.thinker.pool
    messages = [spoken_turn(5)]
    run(cached, speaking(cached, "t0", messages))
    before = pool.hit_tokens
    run(cached, speaking(cached, "t1", messages))
    assert pool.hit_tokens - before == (len(pool_prompt(cached, messages)) - 1) // PAGE * PAGE
    assert seen["t0"].abs().sum() > 0 and torch.equal(seen["t0"], seen["t1"])
    assert_pool_full(cached)


def pool_prompt(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.pipeline.processor.process_chat(messages).token_ids


def test_prefills_aborted_midway_leave_the_pool_full_and_their_pages_right(
    cached, uncached, taps_read, monkeypatch
):
    """Spoken prompts prefilled 8 rows a step and aborted after two steps: every page comes back (the tapped
    rows live in their pages' slots, nothing else holds them); the full pages they computed stay cached, and a
    prompt taking them hands the Talker the rows a whole prefill computes, up to the rounding that prefilling
    in other chunks brings."""
    pipeline = cached.pipeline
    pool = pipeline.thinker.pool
    messages = [spoken_turn(7), {"role": "assistant", "content": "Yes."}, spoken_turn(8)]
    seen, record = taps_read
    record(cached)
    record(uncached)
    scheduler = pipeline.thinker.scheduler
    budget = scheduler.max_num_batched_tokens
    monkeypatch.setattr(scheduler, "max_num_batched_tokens", 8)
    aborted = [speaking(cached, f"a{i}", messages[: 1 + 2 * i]) for i in range(2)]
    assert pipeline.add_requests(aborted) == [None, None]
    for _ in range(2):
        pipeline.step()
    assert pool.num_used > 0
    for new in aborted:
        pipeline.abort(new.request_id)
    scheduler.max_num_batched_tokens = budget
    while pipeline.has_unfinished():
        pipeline.step()
    assert_pool_full(cached)
    assert pool.num_cached > 0
    before = pool.hit_tokens
    run(cached, speaking(cached, "b", messages))
    assert pool.hit_tokens > before
    run(uncached, speaking(uncached, "b-whole", messages))
    torch.testing.assert_close(seen["b"], seen["b-whole"])
    assert_pool_full(cached)


def test_each_spoken_turn_finds_the_whole_turn_before_it(tiny_checkpoint):
    """With pages of 16 rows a prompt's last page holds its last clip's last rows and the reply's first ids: a
    page decode steps computed in part, which a spoken turn (reading kept rows there) cannot take. It prefills
    that page again, and its page takes the key, so every later turn finds the whole turn before it, and not
    only the prompt up to the first reply. Replies go back as their sampled ids (the realtime session's way)."""
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=16, num_kv_pages=64)
    pool = llm.pipeline.thinker.pool
    messages: list[dict] = []
    prompts, found = [], []
    for turn in range(3):
        messages.append(spoken_turn(turn))
        before = pool.hit_tokens
        out = run(llm, speaking(llm, f"t{turn}", messages))
        found.append(pool.hit_tokens - before)
        prompts.append(out.prompt_token_ids)
        reply = out.outputs[0]
        messages.append({"role": "assistant", "content": reply.text, "token_ids": reply.token_ids})
    assert prompts[1][: len(prompts[0])] == prompts[0]
    for turn in (1, 2):
        assert found[turn] >= (len(prompts[turn - 1]) - 1) // 16 * 16, (found, [len(p) for p in prompts])
    assert_pool_full(llm)


def test_a_spoken_turn_finds_what_its_early_prefill_computed(tiny_checkpoint):
    """A realtime turn is prefilled without speech while the user speaks, then answered aloud. The early
    prefill does not take the page the last reply's decode steps computed in part where it holds media rows
    (the spoken answer could not take it either): it computes it again, so the spoken answer finds every page
    the early prefill computed, and not only the conversation up to the last reply."""
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=16, num_kv_pages=64)
    pool = llm.pipeline.thinker.pool
    messages = [spoken_turn(0)]
    reply = run(llm, speaking(llm, "t0", messages)).outputs[0]
    messages += [{"role": "assistant", "content": reply.text, "token_ids": reply.token_ids}, spoken_turn(1)]
    early = speaking(llm, "early", messages)
    early = NewRequest(early.request_id, early.prompt_token_ids, TEXT, early.prompt, early.mrope, early.mm)
    run(llm, early)
    before = pool.hit_tokens
    run(llm, speaking(llm, "t1", messages))
    assert pool.hit_tokens - before >= (len(early.prompt_token_ids) - 1) // 16 * 16
    assert_pool_full(llm)
