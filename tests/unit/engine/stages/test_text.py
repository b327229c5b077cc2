"""The engine end to end on the tiny checkpoint (CPU, float32): batching, preemption, stops, failures, pages."""

import asyncio

import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage import LLM, SamplingParams
from omnistage.config import engine_config
from omnistage.engine.memory.plan import GiB
from omnistage.engine.stages.base import Stage
from omnistage.errors import InvalidRequest, RequestTooLarge
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.request import GenerationRequest

PROMPTS = [
    "Hello",
    "The capital of France is",
    "1, 2, 3, 4,",
    "你好，世界",
    "def fibonacci(n):",
    "A long time ago in a galaxy far, far away there was a",
    "Q: What is the boiling point of water?\nA:",
    "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_llm(checkpoint, **kwargs):
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", page_size=4, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return make_llm(tiny_checkpoint, num_kv_pages=256)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt generated on its own: the reference for every batched run."""
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def assert_pool_full(llm):
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages
    assert not llm.engine.has_unfinished()


def test_greedy_matches_transformers_generate(tiny_checkpoint, llm):
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).thinker.eval()
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        ids = llm.engine.processor.encode(prompt)
        ours = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert ours == theirs[0, len(ids) :].tolist()
    assert_pool_full(llm)


def test_batch_equals_each_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_full(llm)


def test_small_pool_forces_preemption_and_still_matches(tiny_checkpoint, alone):
    # 8 prompts of up to ~20 tokens + 24 generated need ~90 pages of 4 together; 24 pages force preemption
    small = make_llm(tiny_checkpoint, num_kv_pages=24, max_num_batched_tokens=16)
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(small)


def test_preemption_really_happens(tiny_checkpoint):
    small = make_llm(tiny_checkpoint, num_kv_pages=24, max_num_batched_tokens=16)
    engine = small.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), engine.processor.encode(prompt), GREEDY)
    seqs = [engine.scheduler.get(str(i)) for i in range(len(PROMPTS))]
    while engine.has_unfinished():
        engine.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert_pool_full(small)


def test_arrivals_while_others_decode(llm, alone):
    engine = llm.engine
    finished = {}
    for i in range(4):
        engine.add_request(str(i), engine.processor.encode(PROMPTS[i]), GREEDY)
    steps = 0
    while engine.has_unfinished() or len(finished) < len(PROMPTS):
        if steps in (3, 7, 11, 15):  # later prompts join running decodes
            i = 4 + (3, 7, 11, 15).index(steps)
            engine.add_request(str(i), engine.processor.encode(PROMPTS[i]), GREEDY)
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
    assert [finished[i] for i in range(len(PROMPTS))] == alone
    assert_pool_full(llm)


def test_admission_refusal_is_exact(tiny_checkpoint):
    # 175 pages sized by memory (a pool given in pages must hold one request of max_model_len); a page holds
    # its KV and, with prefix caching and a Talker, the hidden row kept beside each token (float32 both)
    text = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker.text
    page_bytes = 128 * (text.kv_bytes_per_token * 2 + text.hidden_size * 4)
    small = LLM(
        model=str(tiny_checkpoint),
        device="cpu",
        dtype="float32",
        page_size=128,
        kv_cache_memory_gib=175.5 * page_bytes / GiB,
        max_model_len=65536,
    )
    with pytest.raises(RequestTooLarge) as err:
        small.generate({"prompt_token_ids": [872] * 212}, SamplingParams(max_tokens=24_000))
    assert str(err.value) == "request needs 190 pages (24,212 tokens) but the pool has 175 pages"
    assert_pool_full(small)


def test_context_and_vocabulary_limits(tiny_checkpoint):
    small = make_llm(tiny_checkpoint, num_kv_pages=64, max_model_len=32)
    with pytest.raises(
        RequestTooLarge,
        match=r"prompt \(10 tokens\) \+ max_tokens \(30\) = 40 tokens exceeds the model's context of 32 tokens",
    ):
        small.generate({"prompt_token_ids": [872] * 10}, SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequest, match="prompt token id 999999 is outside the vocabulary of 152064"):
        small.generate({"prompt_token_ids": [872, 999999]}, SamplingParams())
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        small.generate({"prompt_token_ids": []}, SamplingParams())
    # max_tokens=None fills the context
    out = small.generate({"prompt_token_ids": [872] * 30}, SamplingParams(max_tokens=None, ignore_eos=True))[
        0
    ]
    assert len(out.outputs[0].token_ids) == 2
    assert_pool_full(small)


def test_seeds_reproduce_sampled_outputs(llm):
    def sampled(seed, batch):
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
        prompts = [PROMPTS[0]] + PROMPTS[1:batch]
        outs = llm.generate(prompts, [params] + [others] * (batch - 1))
        return outs[0].outputs[0].token_ids

    first = sampled(7, 1)
    assert sampled(7, 1) == first
    assert sampled(7, 5) == first  # neighbours in the batch do not change a seeded request
    assert sampled(8, 1) != first
    assert_pool_full(llm)


def test_stop_token_ids_stop_strings_min_tokens(llm, alone):
    reference = alone[1]
    stop_id = reference[5]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))[
        0
    ]
    first = reference.index(stop_id)
    assert out.outputs[0].token_ids == reference[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id

    full = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    stop = full[10:14]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert out.outputs[0].text == full[: full.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop

    # with the first token as eos, min_tokens holds the request open and ignore_eos runs to length
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = [reference[0]]
    try:
        stopped = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
        held = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, min_tokens=4, temperature=0.0))[
            0
        ].outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == reference[:1] and stopped.finish_reason == "stop"
    assert len(held.token_ids) >= 4 and reference[0] not in held.token_ids[:4]
    assert_pool_full(llm)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(messages, GREEDY)[0]
    assert chat.prompt_token_ids == [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
    assert (
        chat.outputs[0].token_ids
        == llm.generate({"prompt_token_ids": chat.prompt_token_ids}, GREEDY)[0].outputs[0].token_ids
    )


def test_a_failing_step_is_run_again_chunk_by_chunk(llm, alone, monkeypatch):
    """A batch step that fails once (say, out of memory) runs its chunks one at a time: nobody fails; a lone
    chunk that fails fails its request, and the engine goes on."""
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(step, input_ids=None):
        calls["n"] += 1
        if calls["n"] in (3, 12):
            raise RuntimeError("boom")
        return real(step, input_ids)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    for i in range(2):
        engine.add_request(f"f{i}", engine.processor.encode(PROMPTS[i]), GREEDY)
    finals = _collect(engine)
    assert [finals[f"f{i}"].outputs[0].token_ids for i in range(2)] == alone[:2]
    engine.add_request("lone", engine.processor.encode(PROMPTS[2]), GREEDY)
    calls["n"] = 11
    lone = _collect(engine)["lone"]
    assert lone.outputs[0].finish_reason == "error" and lone.error == "RuntimeError: boom"
    assert_pool_full(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == alone[0]


def test_cancellation_frees_pages_at_once(llm):
    engine = llm.engine
    engine.add_request(
        "c", engine.processor.encode(PROMPTS[5]), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    out = engine.abort("c")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert_pool_full(llm)


def test_async_pipeline_streams_and_cancels(tiny_checkpoint, alone):
    engine = AsyncPipeline.from_config(
        engine_config(
            model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=128
        )
    )

    async def run(i):
        ids = engine.pipeline.processor.encode(PROMPTS[i])
        deltas, last = [], None
        async for out in engine.generate(GenerationRequest(str(i), ids, GREEDY, PROMPTS[i])):
            deltas += out.outputs[0].delta_token_ids
            last = out
        return deltas, last

    async def cancel_midway():
        stream = engine.generate(
            GenerationRequest("x", [872] * 8, SamplingParams(max_tokens=200, ignore_eos=True))
        )
        await stream.__anext__()
        await stream.aclose()
        for _ in range(50):
            if engine.stats()["kv_pages_used"] == 0:
                return True
            await asyncio.sleep(0.02)
        return False

    async def main():
        results = await asyncio.gather(*(run(i) for i in range(len(PROMPTS))))
        return results, await cancel_midway()

    try:
        results, freed = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [d for d, _ in results] == alone
    assert all(last.outputs[0].token_ids == d for d, last in results)
    assert freed and engine.stats()["kv_pages_free"] == 128


def test_prefill_graph_path_equals_eager(tiny_checkpoint, llm, alone):
    """Prefills through the prefill graph runner's padded static buffers (bound eagerly on the CPU, captured on
    a GPU) give the tokens of the plain eager step: text prompts, chunked prompts whose first chunks sample
    nothing, several prompts at once, and an audio prompt whose embeddings carry the encoder's rows."""
    import numpy as np

    from omnistage.engine.buckets import prefill_buckets

    chunked = make_llm(tiny_checkpoint, num_kv_pages=256, max_num_batched_tokens=8)
    for graphs in (make_llm(tiny_checkpoint, num_kv_pages=256), chunked):
        runner = graphs.engine.runner
        runner.capture_graphs([], graphs.engine.max_model_len, False, prefill_buckets=prefill_buckets(64))
        replays = []
        step = runner.prefill_graphs.step
        runner.prefill_graphs.step = lambda *args, seen=replays, run=step: (
            seen.append(args[0].shape[0]) or run(*args)
        )
        assert [graphs.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS] == alone
        assert set(replays) <= {16, 24, 32, 48, 64} and len(replays) >= len(PROMPTS)
        assert_pool_full(graphs)
    assert replays.count(16) > len(
        PROMPTS
    )  # the chunked engine replayed chunks of 8 several times per prompt

    # the prompts at once: their prefills in one step, then chunks beside decode rows, in graphs of several
    # sequences; each sequence's tokens as alone
    together = make_llm(tiny_checkpoint, num_kv_pages=256, max_num_batched_tokens=24)
    runner = together.engine.runner
    runner.capture_graphs([], together.engine.max_model_len, False, prefill_buckets=[16, 24], max_seqs=4)
    slots = []
    step = runner.prefill_graphs.step
    runner.prefill_graphs.step = lambda *args, run=step: slots.append(args[2].seq_lens.shape[0]) or run(*args)
    assert [out.outputs[0].token_ids for out in together.generate(PROMPTS, GREEDY)] == alone
    assert slots and set(slots) == {4}
    assert_pool_full(together)

    clip = (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hi"}]}
    ]
    graphs = make_llm(tiny_checkpoint, num_kv_pages=256)
    graphs.engine.runner.capture_graphs([], graphs.engine.max_model_len, False, prefill_buckets=[16, 64])
    assert (
        graphs.chat(messages, GREEDY)[0].outputs[0].token_ids
        == llm.chat(messages, GREEDY)[0].outputs[0].token_ids
    )


def _audio_prompts(processor, seconds):
    import numpy as np

    prompts = []
    for i, s in enumerate(seconds):
        clip = (0.3 * np.random.default_rng(i).standard_normal(round(s * 16000))).astype(np.float32)
        content = [{"type": "audio", "audio": clip}, {"type": "text", "text": "Transcribe."}]
        prompts.append(processor.process_chat([{"role": "user", "content": content}]))
    return prompts


def test_add_requests_fails_only_the_request_at_fault(llm):
    from omnistage.engine.stages.text_setup import NewRequest

    engine = llm.engine
    prompts = _audio_prompts(engine.processor, [1.2, 3.1, 0.5])
    reference = []
    for i, p in enumerate(prompts):
        engine.add_request(f"ref{i}", p.token_ids, GREEDY, mrope=p.mrope, mm=p.mm)
        reference.append(llm._run([f"ref{i}"])[0].outputs[0].token_ids)
    bad_media = prompts[1].token_ids + [
        llm.pipeline.model_config.thinker.audio_token_id
    ]  # one placeholder too many
    requests = [
        NewRequest("a", prompts[0].token_ids, GREEDY, mrope=prompts[0].mrope, mm=prompts[0].mm),
        NewRequest("bad-media", bad_media, GREEDY, mm=prompts[1].mm),
        NewRequest("too-long", [872] * 10**6, GREEDY),
        NewRequest("c", prompts[2].token_ids, GREEDY, mrope=prompts[2].mrope, mm=prompts[2].mm),
    ]
    errors = engine.add_requests(requests)
    assert errors[0] is None and errors[3] is None
    assert isinstance(errors[1], InvalidRequest) and "audio placeholder tokens but its audio gives" in str(
        errors[1]
    )
    assert isinstance(errors[2], RequestTooLarge)
    outputs = {o.request_id: o.outputs[0].token_ids for o in llm._run(["a", "c"])}
    assert outputs == {"a": reference[0], "c": reference[2]}
    assert_pool_full(llm)


def test_async_pipeline_encodes_the_requests_waiting_together(tiny_checkpoint, monkeypatch):
    """Requests queued while a step runs are admitted at once: one encoder call for all their clips, and
    each gets the tokens it gets alone."""
    import threading

    engine = AsyncPipeline.from_config(
        engine_config(
            model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=512
        )
    )
    stage = engine.pipeline.thinker
    prompts = _audio_prompts(stage.processor, [0.6, 2.2, 4.1, 1.0])
    batches, release, stepping = [], threading.Event(), threading.Event()
    encode_many, step = stage.encoders.encode_many, stage.step
    monkeypatch.setattr(stage.encoders, "encode_many", lambda ps: batches.append(len(ps)) or encode_many(ps))

    def held_step():
        stepping.set()
        release.wait(10)
        return step()

    async def run(name, p):
        outs = [
            o
            async for o in engine.generate(
                GenerationRequest(name, p.token_ids, GREEDY, mrope=p.mrope, mm=p.mm)
            )
        ]
        return outs[-1].outputs[0].token_ids

    async def main():
        alone = [await run(f"alone{i}", p) for i, p in enumerate(prompts)]
        monkeypatch.setattr(stage, "step", held_step)
        first = asyncio.ensure_future(run("first", prompts[0]))  # occupies the engine in a held step
        while not stepping.is_set():
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(run(f"r{i}", p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.1)
        release.set()
        return alone, await first, await asyncio.gather(*rest)

    try:
        alone, first, together = asyncio.run(main())
    finally:
        engine.shutdown()
    assert batches[:4] == [1, 1, 1, 1] and batches[-1] == 4  # the four waiting requests: one encoder call
    assert first == alone[0] and together == alone
    assert engine.stats()["kv_pages_free"] == 512


def test_offline_calls_admit_all_their_prompts_or_none(llm, alone):
    import numpy as np

    with pytest.raises(RequestTooLarge):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [872] * 10**6}], GREEDY)
    assert_pool_full(llm)  # the first prompt was not left behind in the engine
    clip = (0.3 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    good = [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hi"}]}]
    bad = [{"role": "user", "content": [{"type": "audio", "audio": clip[:0]}]}]
    with pytest.raises(InvalidRequest):
        llm.chat([good, bad], GREEDY)
    assert_pool_full(llm)
    assert llm.generate(PROMPTS[:2], GREEDY)[1].outputs[0].token_ids == alone[1]


def _picture(width, height, seed=0):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _media_chats():
    import numpy as np

    clip = (0.3 * np.random.default_rng(3).standard_normal(24000)).astype(np.float32)
    return [
        [{"role": "user", "content": [{"type": "text", "text": "What?"}, {"type": "image", "image": _picture(128, 96)}]}],
        [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hear."}]}],
        [{"role": "user", "content": [
            {"type": "text", "text": "Both:"}, {"type": "audio", "audio": clip[:9000]},
            {"type": "image", "image": _picture(64, 160, seed=1)}, {"type": "text", "text": "then"},
        ]}],
    ]  # fmt: skip


def test_chunked_multimodal_prefill_equals_unchunked(tiny_checkpoint, llm):
    """Image and audio prompts prefilled in chunks of 16 tokens (chunks ending inside and before the media,
    an image chunk beside an audio chunk in one step) give the tokens of the one-chunk prefill."""
    chats = _media_chats()
    alone = [llm.chat(c, GREEDY)[0].outputs[0].token_ids for c in chats]
    # no prefix cache: the second run below prefills every chunk again, not only the pages the first left
    chunked = make_llm(tiny_checkpoint, num_kv_pages=256, max_num_batched_tokens=16, prefix_caching=False)
    assert [chunked.chat(c, GREEDY)[0].outputs[0].token_ids for c in chats] == alone
    media_per_step = []
    execute = chunked.engine.runner.execute

    def spy(step):
        media_per_step.append({_media_in(c) for c in step.chunks} - {""})
        return execute(step)

    chunked.engine.runner.execute = spy
    assert [o.outputs[0].token_ids for o in chunked.chat(chats, GREEDY)] == alone
    assert {"image", "audio"} in media_per_step  # one step held an image chunk and an audio chunk
    assert_pool_full(chunked)


def _media_in(chunk):
    """Which media the chunk's rows cover: "image", "audio" or ""."""
    mm, end = chunk.seq.data.mm, chunk.start + chunk.num_tokens
    covered = [kind for kind, rows in (("image", mm.image_rows), ("audio", mm.audio_rows))
               if ((rows >= chunk.start) & (rows < end)).any()]  # fmt: skip
    return "+".join(covered)


def _collect(engine):
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_failing_request_fails_alone_in_its_step(llm, alone, monkeypatch):
    """A request whose model work raises, batched with others (prefill and decode): only it fails; the others,
    a seeded sampled one among them, get exactly their tokens alone."""
    engine = llm.engine
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    seeded_alone = llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids
    real = engine.runner.execute
    bad_steps = []

    def execute(step, input_ids=None):
        seq = next((c.seq for c in step.chunks if c.seq.request_id == "bad"), None)
        if seq is not None and seq.num_output_tokens >= 2:  # after a few good steps, while others decode
            bad_steps.append(len(step.chunks))
            raise RuntimeError("boom in bad")
        return real(step, input_ids)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("a", engine.processor.encode(PROMPTS[0]), GREEDY)
    engine.add_request("bad", engine.processor.encode(PROMPTS[1]), GREEDY)
    engine.add_request("s", engine.processor.encode(PROMPTS[2]), seeded)
    finals = _collect(engine)
    # the batch launched ahead of the step in flight, the batch again once that was applied, the bad chunk alone
    assert bad_steps == [3, 3, 1]
    bad = finals["bad"]
    assert bad.outputs[0].finish_reason == "error" and "RuntimeError: boom in bad" in bad.error
    assert finals["a"].outputs[0].token_ids == alone[0] and finals["a"].error is None
    assert finals["s"].outputs[0].token_ids == seeded_alone
    assert_pool_full(llm)


def test_a_failure_after_sampling_does_not_draw_twice(llm, monkeypatch):
    """The sampler fails for one row after drawing the seeded rows: on the retry each seeded request draws
    from where its generator stood before the failed step."""
    engine = llm.engine
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (5, 6)]
    reference = [llm.generate(PROMPTS[i], p)[0].outputs[0].token_ids for i, p in enumerate(seeded)]
    bad = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    sample = engine.sampler.sample

    def failing(logits, rows):
        tokens = sample(logits, rows)  # the generators have drawn
        if any(r.params is bad for r in rows) and len(rows[0].output_token_ids) >= 3:
            raise RuntimeError("sampler failed")
        return tokens

    monkeypatch.setattr(engine, "sampler", failing)
    engine.add_request("s0", engine.processor.encode(PROMPTS[0]), seeded[0])
    engine.add_request("s1", engine.processor.encode(PROMPTS[1]), seeded[1])
    engine.add_request("bad", engine.processor.encode(PROMPTS[3]), bad)
    finals = _collect(engine)
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert [finals["s0"].outputs[0].token_ids, finals["s1"].outputs[0].token_ids] == reference
    assert_pool_full(llm)


def test_offline_api_raises_for_a_request_that_failed_in_the_engine(llm, alone, monkeypatch):
    from omnistage.llm import RequestFailed

    engine = llm.engine
    real = engine.runner.execute

    def execute(step, input_ids=None):
        if any(c.seq.prompt_token_ids == [872, 872, 872] for c in step.chunks):
            raise RuntimeError("boom")
        return real(step, input_ids)

    monkeypatch.setattr(engine.runner, "execute", execute)
    with pytest.raises(RequestFailed, match=r"prompt 1 of 2 .*RuntimeError: boom"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [872, 872, 872]}], GREEDY)
    assert_pool_full(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == alone[0]


def test_a_client_leaving_during_a_long_prefill_stops_it_within_a_step(tiny_checkpoint):
    """A client that gives up while its long prompt is being prefilled (no output yet) stops the prefill before
    the engine's next step: its pages come back, and no later step holds any of its work. Every step holds at
    most max_num_batched_tokens tokens."""
    import threading

    engine = AsyncPipeline.from_config(
        engine_config(
            model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=1024,
            max_num_batched_tokens=64,
        )
    )  # fmt: skip
    runner = engine.pipeline.thinker.runner
    execute, steps = runner.execute, []
    inside, leave = threading.Event(), threading.Event()

    def spy(step):
        steps.append({c.seq.request_id: c.num_tokens for c in step.chunks})
        if sum("long" in s for s in steps) == 3:
            inside.set()
            leave.wait(10)  # the client gives up while this step runs
        return execute(step)

    runner.execute = spy

    async def main():
        stream = engine.generate(GenerationRequest("long", [872 + i % 300 for i in range(2000)], GREEDY))
        first = asyncio.ensure_future(stream.__anext__())
        while not inside.is_set():
            await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        leave.set()
        short = [o async for o in engine.generate(GenerationRequest("short", [872] * 8, GREEDY))]
        return short[-1]

    try:
        short = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sum("long" in s for s in steps) == 3  # none after the step during which it left
    assert short.outputs[0].finish_reason == "length"
    assert all(sum(s.values()) <= 64 for s in steps)
    assert engine.stats()["kv_pages_free"] == 1024


def test_a_prompt_whose_hidden_states_are_tapped_replays_a_prefill_graph(tiny_checkpoint):
    """A spoken reply's prompt with media (its rows tapped for the Talker) replays a prefill graph that records
    the tap layer too, and taps what the eager step taps."""
    from omnistage.engine.stages.text_setup import NewRequest
    from omnistage.engine.stages.token_runner import HiddenTap

    results = []
    for graphs in (False, True):
        llm = make_llm(tiny_checkpoint, num_kv_pages=256)
        engine = llm.pipeline.thinker
        layer = llm.pipeline.model_config.talker.accept_hidden_layer
        assert engine.runner.tap_layer == layer  # the pipeline speaks: its Thinker's prefill graphs record it
        replays = []
        if graphs:
            engine.runner.capture_graphs([], engine.max_model_len, False, prefill_buckets=[16, 64, 128])
            step = engine.runner.prefill_graphs.step
            engine.runner.prefill_graphs.step = lambda *args, seen=replays, run=step: (
                seen.append(args[0].shape[0]) or run(*args)
            )
        (prompt,) = _audio_prompts(engine.processor, [1.5])
        rows = torch.arange(3, len(prompt.token_ids) - 2)
        tap = HiddenTap(layer, rows, torch.zeros(len(rows), engine.runner.cfg.hidden_size), rows.numpy())
        request = NewRequest("tapped", prompt.token_ids, GREEDY, mrope=prompt.mrope, mm=prompt.mm, tap=tap)
        assert engine.add_requests([request]) == [None]
        tokens = llm._run(["tapped"])[0].outputs[0].token_ids
        assert bool(replays) == graphs
        results.append((tokens, tap.values))
    (eager_tokens, eager_tap), (graph_tokens, graph_tap) = results
    assert graph_tokens == eager_tokens
    assert eager_tap.abs().sum() > 0
    torch.testing.assert_close(graph_tap, eager_tap, rtol=1e-5, atol=1e-5)


def test_the_text_stage_is_a_stage(llm):
    stage = llm.engine
    assert isinstance(stage, Stage) and stage.name == "Thinker" and stage.device.type == "cpu"
    assert stage.stats()["kv_pages_total"] == stage.pool.num_pages == 256


def test_logprobs_are_the_models_decoding_ahead_or_not(tiny_checkpoint, llm):
    """Each token's logprobs are log_softmax of transformers' logits at its position, whether the step that
    sampled it ran ahead or not; at temperature 0 the sampled token is the top one."""
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).thinker.eval()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=4)
    ids = llm.engine.processor.encode(PROMPTS[1])
    ahead = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    llm.engine.decode_ahead = False
    try:
        synchronous = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    finally:
        llm.engine.decode_ahead = True
    assert synchronous.token_ids == ahead.token_ids and synchronous.logprobs == ahead.logprobs
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids + ahead.token_ids[:-1]])).logits[0, len(ids) - 1 :]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert len(ahead.logprobs) == len(ahead.token_ids) == 12
    for position, (token, found) in enumerate(zip(ahead.token_ids, ahead.logprobs)):
        assert found.token_id == token and found.top[0][0] == token and found.top[0][1] == found.logprob
        assert [t for t, _ in found.top] == expected[position].topk(4).indices.tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in found.top]), expected[position].topk(4).values, rtol=1e-4, atol=1e-4
        )
    assert_pool_full(llm)


def test_logit_bias_steers_the_engine_and_out_of_vocabulary_ids_are_refused(llm, alone):
    banned = alone[0][0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={banned: -100.0})
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert banned not in out.token_ids and out.token_ids != alone[0][:8]
    forced = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate(PROMPTS[0], forced)[0].outputs[0].token_ids == [42] * 8
    vocab = llm.engine.vocab_size
    with pytest.raises(InvalidRequest, match=f"logit_bias: token id {vocab} is outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert_pool_full(llm)
