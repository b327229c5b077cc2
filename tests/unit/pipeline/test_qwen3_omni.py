"""The speaking pipeline on the tiny checkpoint (CPU, float32): batching, the streamed hand-off, caps, text-to-speech,
cancellation and failures. Parity with transformers is in tests/parity/test_speech_parity.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.config import engine_config
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.errors import InvalidRequest
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.qwen3_omni_speech import default_frame_cap, max_speaking
from omnistage.pipeline.side_stream import SideStream
from omnistage.request import MAX_AUDIO_FRAMES, GenerationRequest, SpeechParams, talker_sampling_defaults

QUESTIONS = ["Say hello.", "Name a colour.", "Count to three.", "What is rain?", "Tell a joke.", "Why?"]
VOICES = ["ethan", "chelsie", "aiden", "Ethan", "chelsie", "aiden"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4)


def talker(frames: int | None, seed: int | None = None, **kw) -> SamplingParams:
    fields = {**vars(talker_sampling_defaults()), "max_tokens": frames, "seed": seed, **kw}
    return SamplingParams(**fields)


def speak(llm: LLM, i: int, frames: int, text_tokens: int) -> dict:
    """The request of index i: its own question, voice, lengths and seeds (sampled Talker, greedy Thinker)."""
    return {
        "messages": [{"role": "user", "content": QUESTIONS[i]}],
        "params": SamplingParams(max_tokens=text_tokens, temperature=0.0),
        "speech": SpeechParams(
            VOICES[i], talker(frames, seed=100 + i, ignore_eos=True, min_tokens=frames or 0)
        ),
    }


def requests(llm: LLM, specs: list[dict], first_id: int = 0) -> list[NewRequest]:
    out = []
    for n, spec in enumerate(specs):
        prompt = llm.pipeline.processor.process_chat(spec["messages"])
        out.append(
            NewRequest(
                str(first_id + n),
                prompt.token_ids,
                spec["params"],
                prompt.prompt,
                prompt.mrope,
                prompt.mm,
                spec["speech"],
            )
        )
    return out


def run(llm: LLM, new: list[NewRequest]) -> dict[str, list]:
    """Every output of every request, by request id, stepping the pipeline until all have finished."""
    pipeline = llm.pipeline
    assert pipeline.add_requests(new) == [None] * len(new)
    seen: dict[str, list] = {r.request_id: [] for r in new}
    while pipeline.has_unfinished():
        for out in pipeline.step():
            seen[out.request_id].append(out)
    return seen


def assert_pools_full(llm: LLM) -> None:
    pipeline = llm.pipeline
    assert not pipeline.has_unfinished()
    assert pipeline.thinker.pool.num_free == pipeline.thinker.pool.num_pages
    assert (
        pipeline.speech_stages.talker_stage.pool.num_free
        == pipeline.speech_stages.talker_stage.pool.num_pages
    )
    assert not pipeline.speech_stages.streamer.streams


def test_six_speaking_requests_together_equal_each_alone(llm):
    """Different voices, text lengths and frame caps, seeded Talker sampling: batched == alone."""
    specs = [speak(llm, i, frames=6 + 3 * i, text_tokens=3 + i) for i in range(6)]
    alone = [
        run(llm, requests(llm, [spec], first_id=10 * i))[str(10 * i)][-1] for i, spec in enumerate(specs)
    ]
    together = run(llm, requests(llm, specs, first_id=100))
    for i, spec in enumerate(specs):
        final = together[str(100 + i)][-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert len(final.audio_codes) == spec["speech"].talker.max_tokens == final.num_audio_frames
        assert final.audio_codes == alone[i].audio_codes
        # same codes; the waveform differs by float32 rounding in a batched decode, which the random decoder
        # amplifies to ~1e-4 of max (transformers' own float32 is 3e-4 off its float64: test_speech_parity)
        np.testing.assert_allclose(final.audio, alone[i].audio, atol=1e-3 * np.abs(alone[i].audio).max())
    assert_pools_full(llm)


def test_streamed_chunks_make_up_the_audio_and_the_talker_waits_for_text(llm):
    """The Talker starts with the Thinker's first token (a token the Thinker yields unfinished is spoken), so
    the first audio chunk (2 frames) comes out of the second step; it never reads a text row before the Thinker
    has yielded it; the chunks concatenated are the final audio."""
    pipeline = llm.pipeline
    (new,) = requests(llm, [speak(llm, 0, frames=30, text_tokens=8)])
    assert pipeline.add_requests([new]) == [None]
    outputs, text_at_start, fed, first_audio_step = [], None, [], None
    speech = pipeline._speaking[new.request_id]
    while pipeline.has_unfinished():
        step = pipeline.step()
        outputs += step
        if speech.talker_started and text_at_start is None:
            text_at_start = len(speech.generated)
        if first_audio_step is None and any(o.audio_delta is not None for o in step):
            first_audio_step = len(fed) + 1
        fed.append((speech.rows_fed, len(speech.generated), speech.text_done))
    assert text_at_start == 1 and first_audio_step == 2
    # text row k is spoken token k + 1: yielded once the Thinker has k + 2 tokens
    for rows_fed, generated, text_done in fed:
        assert text_done or rows_fed == 0 or generated >= (rows_fed - 1) + 2
    assert any(not text_done and rows_fed > 0 for rows_fed, _, text_done in fed)  # it ran beside the Thinker
    final = outputs[-1]
    assert final.finished and [o.finished for o in outputs].count(True) == 1
    deltas = [o.audio_delta for o in outputs if o.audio_delta is not None]
    assert len(deltas) >= 2
    assert np.array_equal(np.concatenate(deltas), final.audio)
    samples_per_frame = pipeline.speech_stages.code2wav.config.samples_per_frame
    assert len(final.audio) == samples_per_frame * 30 - pipeline.speech_stages.code2wav.lookahead
    assert "".join(o.outputs[0].delta_text for o in outputs) == final.outputs[0].text
    assert_pools_full(llm)


def test_without_a_frame_cap_the_audio_follows_the_text(llm):
    spec = speak(llm, 1, frames=None, text_tokens=5)
    spec["speech"] = SpeechParams("ethan", talker(None, seed=1, ignore_eos=True))
    final = run(llm, requests(llm, [spec]))["0"][-1]
    assert final.num_audio_frames == default_frame_cap(5 - 1)  # the last text token is never spoken


def test_a_one_token_reply_says_nothing(llm):
    spec = speak(llm, 2, frames=5, text_tokens=1)
    final = run(llm, requests(llm, [spec]))["0"][-1]
    assert final.finished and len(final.outputs[0].token_ids) == 1
    assert final.audio_codes == [] and final.audio.shape == (0,)
    assert_pools_full(llm)


def test_text_to_speech_speaks_the_given_reply_without_the_thinker(llm, monkeypatch):
    pipeline = llm.pipeline
    tts = pipeline.frontend.tts_prompt("Good morning, and welcome.")
    assert tts.token_ids[-3:-1] == [
        pipeline.speech_stages.tokens.im_start,
        pipeline.speech_stages.tokens.assistant,
    ]
    monkeypatch.setattr(pipeline.thinker, "step", lambda: pytest.fail("the Thinker ran"))
    speech = SpeechParams(
        "aiden", talker(12, seed=3, ignore_eos=True, min_tokens=12), reply_token_ids=tts.reply_token_ids
    )
    new = NewRequest("tts", tts.token_ids, SamplingParams(), tts.prompt, speech=speech)
    final = run(llm, [new])["tts"][-1]
    assert final.outputs[0].text == "Good morning, and welcome."
    assert final.outputs[0].token_ids == tts.reply_token_ids
    assert final.num_audio_frames == 12 and len(final.audio) > 0
    assert_pools_full(llm)


def test_speech_requests_are_checked_before_anything_runs(llm, tiny_checkpoint):
    pipeline = llm.pipeline
    ids = pipeline.processor.process_chat([{"role": "user", "content": "Hi"}]).token_ids
    params = SamplingParams(max_tokens=4)

    def spoken(ids: list[int], speech: SpeechParams) -> GenerationRequest:
        return GenerationRequest("spoken", ids, params, speech=speech)

    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'.*aiden"):
        pipeline.validate(spoken(ids, SpeechParams("nobody")))
    with pytest.raises(InvalidRequest, match="opening the assistant's turn|ends by opening"):
        pipeline.validate(spoken(pipeline.processor.encode("plain text"), SpeechParams()))
    with pytest.raises(InvalidRequest, match="no text to speak"):
        pipeline.validate(spoken(ids, SpeechParams(reply_token_ids=[])))
    for frames in (MAX_AUDIO_FRAMES + 1, 100_000, 10**9):  # the Talker's sequences are planned for the cap
        with pytest.raises(InvalidRequest, match="max_frames must be at most 4,096") as refused:
            pipeline.validate(spoken(ids, SpeechParams(talker=talker(frames))))
        assert refused.value.field == "max_frames"  # what the server names as the route's field
    quiet = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", speech=False)
    assert quiet.pipeline.voices == ()
    with pytest.raises(InvalidRequest, match="does not speak"):
        quiet.chat([{"role": "user", "content": "Hi"}], params, modalities=["text", "audio"])
    assert quiet.chat([{"role": "user", "content": "Hi"}], params)[0].audio is None


def test_cancelled_and_failed_speaking_requests_leave_every_pool_full(llm, monkeypatch):
    """A client leaving mid-speech, and a request whose code-predictor call fails, free everything; the
    request speaking beside the failed one is unaffected."""
    engine = AsyncPipeline(llm.pipeline)

    async def leave_after_first_audio():
        spec = speak(llm, 3, frames=200, text_tokens=40)
        (new,) = requests(llm, [spec])
        stream = engine.generate(new)
        async for out in stream:
            if out.audio_delta is not None:
                break
        await stream.aclose()

    try:
        asyncio.run(leave_after_first_audio())
        for _ in range(200):
            if not llm.pipeline.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        engine.shutdown()
    assert_pools_full(llm)

    pipeline = llm.pipeline
    specs = [speak(llm, 4, frames=8, text_tokens=4), speak(llm, 5, frames=8, text_tokens=4)]
    alone = run(llm, requests(llm, specs[1:], first_id=50))["50"][-1]
    predict = pipeline.steps.handoff.run_frames

    def failing_for_60(speeches, hidden, code0):
        if any(speech.request_id == "60" for speech in speeches):
            raise RuntimeError("injected failure")
        return predict(speeches, hidden, code0)

    # the batch fails on the Talker's device-side ids, then again once they are read back, then 60 fails alone
    monkeypatch.setattr(pipeline.steps.handoff, "run_frames", failing_for_60)
    outs = run(llm, requests(llm, specs, first_id=60))
    victim, neighbour = outs["60"][-1], outs["61"][-1]
    assert (
        victim.finished and victim.outputs[0].finish_reason == "error" and "injected failure" in victim.error
    )
    assert neighbour.error is None and neighbour.audio_codes == alone.audio_codes
    assert_pools_full(llm)


def test_talkers_start_together_and_a_failing_start_fails_alone(llm, monkeypatch):
    """Requests whose first tokens come in one step start their Talkers in one hand-off; one that cannot
    start fails alone, and its neighbour speaks what it speaks alone."""
    pipeline = llm.pipeline
    handoff, talker = pipeline.steps.handoff, pipeline.speech_stages.talker_stage
    specs = [speak(llm, 2, frames=8, text_tokens=4), speak(llm, 3, frames=8, text_tokens=4)]
    alone = run(llm, requests(llm, specs[1:], first_id=80))["80"][-1]
    batches: list[list[str]] = []
    start, add = handoff.start_talkers, talker.add

    def recording(speeches):
        batches.append([speech.request_id for speech in speeches])
        start(speeches)

    def failing_for_70(request_id, *args):
        if request_id == "70":
            raise RuntimeError("injected failure")
        add(request_id, *args)

    monkeypatch.setattr(handoff, "start_talkers", recording)
    monkeypatch.setattr(talker, "add", failing_for_70)
    outs = run(llm, requests(llm, specs, first_id=70))
    victim, neighbour = outs["70"][-1], outs["71"][-1]
    assert batches == [["70", "71"], ["70"], ["71"]]  # together, then each alone after the failure
    assert victim.outputs[0].finish_reason == "error" and "injected failure" in victim.error
    assert neighbour.error is None and neighbour.audio_codes == alone.audio_codes
    assert_pools_full(llm)


def test_ignore_eos_never_draws_the_codec_end(llm, monkeypatch):
    """A Talker that would say its end at once: with ignore_eos it speaks every frame asked for, else nothing."""
    pipeline = llm.pipeline
    eos = pipeline.model_config.talker.codec_eos_token_id
    logits = pipeline.speech_stages.talker.compute_logits

    def eager_to_end(hidden):
        out = logits(hidden)
        out[:, eos] = out.max() + 100
        return out

    monkeypatch.setattr(pipeline.speech_stages.talker, "compute_logits", eager_to_end)
    spec = speak(llm, 0, frames=7, text_tokens=3)
    assert run(llm, requests(llm, [spec]))["0"][-1].num_audio_frames == 7
    spec["speech"] = SpeechParams("ethan", talker(7, seed=1))
    final = run(llm, requests(llm, [spec], first_id=1))["1"][-1]
    assert final.finished and final.num_audio_frames == 0 and final.audio_codes == []
    assert_pools_full(llm)


def test_talkers_preempted_for_pages_speak_as_alone(tiny_checkpoint):
    """A Talker pool of 16 pages for three requests of ~10 pages each: the newest Talkers are preempted and
    recomputed from their kept input rows, and every request still speaks the codes it speaks alone."""
    from omnistage.engine.memory.plan import GiB

    probe = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, speech=False)
    text = probe.pipeline.model_config.talker.text
    gib = 16 * 4 * text.kv_bytes_per_token / GiB
    small = LLM(
        str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4,
        stages={"talker": {"kv_cache_memory_gib": gib}},
    )  # fmt: skip
    assert small.pipeline.speech_stages.talker_stage.pool.num_pages == 16
    specs = [speak(small, i, frames=20, text_tokens=6) for i in range(3)]
    for spec in specs:
        spec[
            "speech"
        ].talker.temperature = 0.0  # greedy: a recomputed prefill rounds otherwise than decode steps
    alone = [
        run(small, requests(small, [spec], first_id=10 * i))[str(10 * i)][-1] for i, spec in enumerate(specs)
    ]
    preempted = []
    stage = small.pipeline.speech_stages.talker_stage
    original = stage.scheduler._preempt
    stage.scheduler._preempt = lambda seq: preempted.append(seq.request_id) or original(seq)
    together = run(small, requests(small, specs, first_id=100))
    assert preempted
    for i in range(3):
        assert together[str(100 + i)][-1].audio_codes == alone[i].audio_codes
    assert_pools_full(small)


def test_the_speech_device_is_checked_against_the_machine(tiny_checkpoint):
    from omnistage.errors import ConfigError

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(
        ConfigError, match=rf"engine.stages.talker.device: cuda:{count}, but this machine has"
    ):
        LLM(str(tiny_checkpoint), device="cpu", stages={"talker": {"device": f"cuda:{count}"}})
    with pytest.raises(ConfigError, match="stages.talker.device"):
        LLM(str(tiny_checkpoint), device="cpu", stages={"talker": {"device": "tpu"}})
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", stages={"talker": {"device": "cpu"}})
    assert llm.pipeline.speech_device == torch.device("cpu")


def test_thinker_steps_beside_the_speaking_steps_change_nothing_but_timing(llm, monkeypatch):
    """The GPU's overlap (the Thinker's step on its own thread while the speech stages step, side_stream.py),
    run on the CPU: the same text and codes as one after the other, a failure during an overlapped step fails
    its request alone (its Thinker abort waits for the step), and every pool is full after."""
    pipeline = llm.pipeline
    specs = [speak(llm, i, frames=10, text_tokens=14) for i in range(3)]
    sequential = run(llm, requests(llm, specs, first_id=200))
    side = SideStream(torch.device("cpu"), "thinker")
    submitted = []
    submit = side.submit
    monkeypatch.setattr(side, "submit", lambda work: submitted.append(work) or submit(work))
    monkeypatch.setattr(pipeline.steps, "_thinker_side", side)
    monkeypatch.setattr(pipeline.steps, "overlap", True)
    # the CPU captures no graphs: a decode step stands in for a replay
    monkeypatch.setattr(
        pipeline.thinker, "replays_next_step", lambda: pipeline.thinker.scheduler.decodes_only
    )
    beside = run(llm, requests(llm, specs, first_id=300))
    assert submitted, "no Thinker step ran beside a speaking step"
    for i in range(3):
        ours, theirs = beside[str(300 + i)][-1], sequential[str(200 + i)][-1]
        assert ours.error is None and ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.audio_codes == theirs.audio_codes and len(ours.audio_codes) == 10
    assert_pools_full(llm)

    predict = pipeline.steps.handoff.run_frames

    def failing_for_401_at_its_fourth_frame(speeches, hidden, code0):
        if any(speech.request_id == "401" and len(speech.codes) == 3 for speech in speeches):
            assert pipeline.steps._deferred_aborts is not None  # a Thinker step is running beside this one
            raise RuntimeError("injected failure")
        return predict(speeches, hidden, code0)

    monkeypatch.setattr(pipeline.steps.handoff, "run_frames", failing_for_401_at_its_fourth_frame)
    outs = run(llm, requests(llm, specs[:2], first_id=400))
    assert "injected failure" in outs["401"][-1].error and len(outs["401"][-1].outputs[0].token_ids) < 14
    assert outs["400"][-1].audio_codes == sequential["200"][-1].audio_codes
    assert sum(out.finished for out in outs["401"]) == 1
    assert_pools_full(llm)
    side.close()


def test_a_speaking_step_that_raises_beside_the_thinker_waits_for_its_step(llm, monkeypatch):
    """The step loop meets the error and aborts everything: by then the Thinker's step on its thread has ended
    and the aborts it deferred have run, so nothing touches the Thinker from two threads and every pool empties."""
    pipeline = llm.pipeline
    side = SideStream(torch.device("cpu"), "thinker")
    monkeypatch.setattr(pipeline.steps, "_thinker_side", side)
    monkeypatch.setattr(pipeline.steps, "overlap", True)
    monkeypatch.setattr(
        pipeline.thinker, "replays_next_step", lambda: pipeline.thinker.scheduler.decodes_only
    )
    new = requests(llm, [speak(llm, i, frames=10, text_tokens=14) for i in range(2)], first_id=500)
    assert pipeline.add_requests(new) == [None, None]
    while not pipeline.steps._beside():
        pipeline.step()
    speak_here, finished = pipeline.steps.handoff.step, []

    def failing():
        # deferred: the Thinker is busy
        pipeline.steps.fail(pipeline._speaking["500"], "speech failed: injected")
        speak_here()
        raise RuntimeError("injected failure in the speaking step")

    submit = side.submit
    monkeypatch.setattr(side, "submit", lambda work: submit(lambda: finished.append(work()) or finished[-1]))
    monkeypatch.setattr(pipeline.steps.handoff, "step", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        pipeline.step()
    assert finished and pipeline.steps._deferred_aborts is None
    assert pipeline.thinker.scheduler.get("500") is None  # its deferred abort ran
    for request in new:
        pipeline.abort(request.request_id)
    assert_pools_full(llm)
    side.close()


def test_code_predictor_on_the_talkers_device_side_ids_changes_nothing(llm, monkeypatch):
    """Each speaking step launches the code predictor on the ids the Talker sampled before they reach the host
    (`Handoff.launch_frames`). Against the frames predicted after the read-back: the same codes, audio and text,
    also for a request that samples codec EOS mid-way (its frame of that step is dropped) beside others that go
    on, and every pool is full after."""
    pipeline = llm.pipeline
    stage = pipeline.speech_stages.talker_stage
    eos = llm.pipeline.model_config.talker.codec_eos_token_id
    sample = stage._sample

    def eos_at_frame_five_for_request_one(logits, sampling):
        ids = sample(logits, sampling)
        for row, chunk in enumerate(sampling):
            if chunk.seq.request_id.endswith("1") and chunk.seq.num_output_tokens == 5:
                ids[row] = eos
        return ids

    monkeypatch.setattr(stage, "_sample", eos_at_frame_five_for_request_one)
    specs = [speak(llm, i, frames=9, text_tokens=6) for i in range(3)]
    specs[1]["speech"] = SpeechParams(VOICES[1], talker(9, seed=101))  # EOS ends it (the others ignore it)
    launched = []
    launch = pipeline.steps.handoff.launch_frames
    monkeypatch.setattr(
        pipeline.steps.handoff, "launch_frames", lambda f: launched.append(out := launch(f)) or out
    )
    early = run(llm, requests(llm, specs, first_id=500))
    assert any(frames is not None for frames in launched)
    monkeypatch.setattr(pipeline.steps.handoff, "launch_frames", lambda flights: None)
    after = run(llm, requests(llm, specs, first_id=600))
    for i in range(3):
        ours, theirs = early[str(500 + i)][-1], after[str(600 + i)][-1]
        assert ours.error is None and theirs.error is None
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.audio_codes == theirs.audio_codes
        assert len(ours.audio_codes) == (5 if i == 1 else 9)
        np.testing.assert_array_equal(ours.audio, theirs.audio)
    assert_pools_full(llm)


def assert_nothing_held(llm: LLM) -> None:
    """Every pool full and no speaking request's state left anywhere (its audio, codes, stream, sequence)."""
    assert_pools_full(llm)
    pipeline = llm.pipeline
    assert not pipeline._speaking and not pipeline.queue and not pipeline.queue.refused
    assert not pipeline.speech_stages.talker_stage.scheduler._unfinished


def test_speaking_requests_beyond_the_bound_wait_their_turn(llm, monkeypatch):
    """With two speaking at a time, four speeches and a text request: the text request is never held, the later
    speeches wait (counted as waiting) and start as the first end, first come first served, and every one
    speaks the same codes as with all four at once."""
    pipeline = llm.pipeline
    specs = [speak(llm, i, frames=6, text_tokens=3) for i in range(4)]
    together = run(llm, requests(llm, specs, first_id=200))
    monkeypatch.setattr(pipeline.queue, "max_speaking", 2)
    new = requests(llm, specs, first_id=300)
    text = requests(llm, [{**speak(llm, 5, 1, 3), "speech": None}], first_id=400)
    assert pipeline.add_requests(new + text) == [None] * 5
    assert pipeline.num_waiting == 2 + pipeline.thinker.num_waiting and pipeline.stats()["num_speaking"] == 2
    seen: dict[str, list] = {r.request_id: [] for r in new + text}
    started, steps, text_done = [], 0, None
    while pipeline.has_unfinished():
        assert len(pipeline._speaking) <= 2
        for out in pipeline.step():
            seen[out.request_id].append(out)
            if out.request_id == "400" and out.finished:
                text_done = steps
        started += [i for i in pipeline._speaking if i not in started]
        steps += 1
    assert started == ["300", "301", "302", "303"]
    assert text_done is not None and text_done < steps // 2  # done while the first two still spoke
    for i in range(4):
        final, alone = seen[str(300 + i)][-1], together[str(200 + i)][-1]
        assert final.finished and final.error is None and final.num_audio_frames == 6
        assert final.audio_codes == alone.audio_codes
    assert_nothing_held(llm)


def test_a_waiting_speaking_request_can_be_aborted(llm, monkeypatch):
    pipeline = llm.pipeline
    monkeypatch.setattr(pipeline.queue, "max_speaking", 1)
    new = requests(llm, [speak(llm, i, frames=4, text_tokens=2) for i in range(3)], first_id=500)
    assert pipeline.add_requests(new) == [None] * 3
    aborted = pipeline.abort("502")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert pipeline.num_waiting == 1 + pipeline.thinker.num_waiting
    seen = {"500": [], "501": []}
    while pipeline.has_unfinished():
        for out in pipeline.step():
            seen[out.request_id].append(out)
    assert [seen[i][-1].num_audio_frames for i in ("500", "501")] == [4, 4]
    assert_nothing_held(llm)


def test_every_talker_row_may_speak_on_a_gpu_by_default(tiny_checkpoint):
    """The bound on speaking requests defaults to the Talker's batch on a GPU, not Code2Wav's streams per call:
    on the H200 a bound of 16 (Code2Wav's) held T2S at ~100 audio s/s from c=16 on and queued c=64's first
    packets for 2.5 s (benchmarks/RESULTS.md, "Under load"). Eagerly, where a step's cost grows with its rows,
    it stays the smaller of the two."""
    config = engine_config(
        model=str(tiny_checkpoint), max_num_seqs=64, stages={"code2wav": {"max_streams": 16}}
    )
    assert max_speaking(config, torch.device("cuda", 0)) == config.stage("talker").max_batch == 64
    assert max_speaking(config, torch.device("cpu")) == 16
    eager = engine_config(model=str(tiny_checkpoint), max_num_seqs=64, enforce_eager=True)
    assert max_speaking(eager, torch.device("cuda", 0)) == 16
    given = engine_config(model=str(tiny_checkpoint), max_num_speaking=3)
    assert max_speaking(given, torch.device("cuda", 0)) == max_speaking(given, torch.device("cpu")) == 3
