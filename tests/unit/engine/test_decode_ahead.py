"""Decoding ahead (engine/decode_ahead.py) on the tiny checkpoint (CPU, float32): the same tokens, texts, stops
and pages as stepping in lockstep, constrained requests among them; aborts and arrivals while a step is in flight;
when a step may run ahead."""

import json
from types import SimpleNamespace

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.decode_ahead import (
    PLACEHOLDER,
    Launched,
    decodes_ahead,
    may_run_ahead,
    settle,
)
from omnistage.engine.kv_cache import PagePool
from omnistage.engine.scheduler import ScheduledChunk, Scheduler
from omnistage.engine.sequence import Sequence
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.request import StructuredOutput, ToolSchema

PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is the boiling point of water?\nA:",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def make_llm(checkpoint, ahead):
    return LLM(
        model=str(checkpoint),
        device="cpu",
        dtype="float32",
        page_size=4,
        num_kv_pages=256,
        decode_ahead=ahead,
    )


@pytest.fixture(scope="module")
def lockstep(tiny_checkpoint):
    return make_llm(tiny_checkpoint, False)


@pytest.fixture(scope="module")
def ahead(tiny_checkpoint):
    return make_llm(tiny_checkpoint, True)


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished() and engine._launched is None
    assert engine.pool.num_free == engine.pool.num_pages


def run(llm, requests, late=(), after=3):
    """Every request's outputs in order; `late` ones are added after `after` steps, with steps in flight."""
    engine = llm.engine
    streams = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, engine.processor.encode(prompt), params)
    steps = 0
    while engine.has_unfinished() or late:
        if steps == after:
            for rid, prompt, params in late:
                engine.add_request(rid, engine.processor.encode(prompt), params)
            late = ()
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
        steps += 1
    return streams


def summary(outputs):
    final = outputs[-1].outputs[0]
    deltas = [t for o in outputs for t in o.outputs[0].delta_token_ids]
    text = "".join(o.outputs[0].delta_text for o in outputs)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert PLACEHOLDER not in final.token_ids
    return final.token_ids, deltas, final.text, text, final.finish_reason, final.stop_reason


def test_decoding_ahead_gives_what_lockstep_gives(lockstep, ahead, monkeypatch):
    """Greedy, seeded sampling, a stop token, a stop string, min_tokens with eos, a penalised request (which
    holds its batch in lockstep while it runs), requests arriving mid-decode: the same tokens, deltas, texts
    and finish reasons, every page back; and steps did launch ahead."""
    reference = lockstep.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    stop_token = reference.token_ids[6]
    stop_string = reference.text[len(reference.text) // 2 :][:3]
    requests = [
        ("greedy", PROMPTS[0], GREEDY),
        (
            "seeded",
            PROMPTS[2],
            SamplingParams(max_tokens=15, temperature=1.0, top_k=20, seed=3, ignore_eos=True),
        ),
        (
            "stop-token",
            PROMPTS[1],
            SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_token]),
        ),
    ]
    late = [
        ("stop-string", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop_string])),
        ("min-tokens", PROMPTS[3], SamplingParams(max_tokens=12, min_tokens=9, temperature=0.8, seed=5)),
        ("one-token", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0)),
    ]
    expected = {rid: summary(outs) for rid, outs in run(lockstep, requests, late).items()}
    launches = []
    launch = ahead.engine._launch
    monkeypatch.setattr(
        ahead.engine, "_launch", lambda chunks, prev: launches.append(len(chunks)) or launch(chunks, prev)
    )
    got = {rid: summary(outs) for rid, outs in run(ahead, requests, late).items()}
    assert got == expected
    assert expected["stop-token"][4] == "stop" and expected["stop-string"][4] == "stop"
    assert len(launches) >= 10 and max(launches) >= 4
    penalised = [
        (
            "penalised",
            PROMPTS[0],
            SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        )
    ]
    launches.clear()
    both = requests[:1] + penalised
    assert {r: summary(o) for r, o in run(ahead, both).items()} == {
        r: summary(o) for r, o in run(lockstep, both).items()
    }
    assert not launches  # the greedy request's batch-mate decodes in lockstep, so the batch does
    assert_idle(ahead)
    assert_idle(lockstep)


SCHEMA = StructuredOutput(
    json_schema=json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
            "additionalProperties": False,
        }
    )
)
# several tokens of fixed text, then a choice: the grammar ends the sequence in a step decoded ahead
CHOICE = StructuredOutput(grammar='root ::= "Answer: " ("yes" | "no" | "maybe not") "."')
TOOL = StructuredOutput(
    tools=(
        ToolSchema("now", json.dumps({"type": "object", "properties": {}, "additionalProperties": False})),
    ),
    parallel_tool_calls=False,
)


def constrained(structured, **params):
    return SamplingParams(
        **({"max_tokens": 48, "temperature": 0.0, "skip_special_tokens": False} | params),
        structured=structured,
    )


def test_constrained_requests_decode_ahead_to_the_tokens_of_lockstep(lockstep, ahead, monkeypatch):
    """A JSON schema, a choice grammar, a required tool call, greedy and seeded, in one batch with free requests:
    the same tokens, texts and finish reasons as stepping in lockstep, each grammar's end ending its request,
    every page back; and the steps with constrained rows in them did launch ahead."""
    requests = [
        ("schema", PROMPTS[1], constrained(SCHEMA)),
        ("free", PROMPTS[0], GREEDY),
        ("choice", PROMPTS[3], constrained(CHOICE)),
        ("tool", PROMPTS[2], constrained(TOOL)),
        ("seeded", PROMPTS[1], constrained(SCHEMA, temperature=1.0, seed=11)),
        ("free-seeded", PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True)),
    ]
    late = [("late-choice", PROMPTS[0], constrained(CHOICE))]
    expected = {rid: summary(outs) for rid, outs in run(lockstep, requests, late).items()}
    launched = []
    launch = ahead.engine._launch
    monkeypatch.setattr(
        ahead.engine,
        "_launch",
        lambda chunks, prev: launched.append({c.seq.request_id for c in chunks}) or launch(chunks, prev),
    )
    got = {rid: summary(outs) for rid, outs in run(ahead, requests, late).items()}
    assert got == expected
    for rid in ("schema", "choice", "tool", "seeded", "late-choice"):
        assert expected[rid][4] == "stop", (rid, expected[rid][2])  # the grammar ended it, not the length
    assert expected["choice"][2] in ("Answer: yes.", "Answer: no.", "Answer: maybe not.")
    assert json.loads(expected["schema"][2]).keys() == {"name", "ok"}
    assert sum("schema" in ids and "free" in ids for ids in launched) >= 5
    assert any("late-choice" in ids for ids in launched)
    assert_idle(ahead)
    assert_idle(lockstep)


def test_an_abort_with_a_token_in_flight(lockstep, ahead):
    """Aborted while its step is in flight: its output has the tokens read back so far, no placeholder; no page
    is kept and nothing is left in flight; the next request is unaffected."""
    engine = ahead.engine
    reference = lockstep.generate(PROMPTS[2], GREEDY)[0].outputs[0].token_ids
    engine.add_request("x", engine.processor.encode(PROMPTS[2]), GREEDY)
    seen = []
    while engine._launched is None or len(seen) < 5:
        seen += [t for o in engine.step() for t in o.outputs[0].delta_token_ids]
    assert engine.scheduler.get("x").output_token_ids[-1] == PLACEHOLDER
    out = engine.abort("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == seen == reference[: len(seen)]
    assert_idle(ahead)
    assert ahead.generate(PROMPTS[2], GREEDY)[0].outputs[0].token_ids == reference


def test_a_step_whose_ids_cannot_be_read_back_fails_its_requests(ahead, monkeypatch):
    """Reading a launched step's ids back raises (say, a device fault): its requests end with an error, their
    tokens those read back before it, no placeholder; every page is back and the engine serves on."""
    engine = ahead.engine
    reference = ahead.generate(PROMPTS[3], GREEDY)[0].outputs[0].token_ids
    for rid in ("a", "b"):
        engine.add_request(rid, engine.processor.encode(PROMPTS[3]), GREEDY)
    calls = {"n": 0}
    tokens = Launched.tokens

    def failing(launched):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device fault")
        return tokens(launched)

    monkeypatch.setattr(Launched, "tokens", failing)
    finals = {}
    while engine.has_unfinished():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    for rid in ("a", "b"):
        out = finals[rid]
        assert out.outputs[0].finish_reason == "error" and "device fault" in out.error
        token_ids = out.outputs[0].token_ids
        assert 0 < len(token_ids) < len(reference) and token_ids == reference[: len(token_ids)]
    assert_idle(ahead)
    monkeypatch.undo()
    assert ahead.generate(PROMPTS[3], GREEDY)[0].outputs[0].token_ids == reference


def _seq(rid, output_tokens, max_tokens, left=1, eligible=True):
    seq = Sequence(rid, [1, 2, 3], max_tokens, data=SimpleNamespace(decodes_ahead=eligible))
    seq.output_token_ids = [7] * output_tokens
    seq.num_computed_tokens = seq.num_tokens - left
    return seq


def _scheduler(seqs, num_pages=8, page_size=4):
    pool = PagePool(num_pages, page_size)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    for seq in seqs:
        seq.page_ids = pool.allocate(pool.pages_for(seq.num_tokens - 1))
        seq.status = seq.status.RUNNING
        scheduler.running.append(seq)
    return scheduler


def _launched(seqs):
    chunks = [ScheduledChunk(seq, seq.num_computed_tokens - 1, 1) for seq in seqs]
    return Launched.start(chunks, torch.arange(10, 10 + len(seqs)))


def eligible(seq):
    return seq.data.decodes_ahead


def test_a_step_that_fails_to_sample_ahead_runs_again_in_lockstep(lockstep, ahead, monkeypatch):
    """Sampling a step launched ahead raises once, after the ids in flight were applied: the step runs again one
    step after the other, its seeded draws where they stood, and every request gets what lockstep gives."""
    requests = [
        ("choice", PROMPTS[3], constrained(CHOICE)),
        ("seeded", PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True)),
    ]
    expected = {rid: summary(outs) for rid, outs in run(lockstep, requests).items()}
    calls = {"n": 0}
    sample = ahead.engine._sample_ahead

    def failing(chunks, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("sampler fault")
        return sample(chunks, logits)

    monkeypatch.setattr(ahead.engine, "_sample_ahead", failing)
    assert {rid: summary(outs) for rid, outs in run(ahead, requests).items()} == expected
    assert calls["n"] > 4
    assert_idle(ahead)


def test_which_requests_decode_ahead():
    """A constrained request decodes ahead (its mask is filled once its step's forward pass is queued); a
    penalised one and one whose tokens feed a later stage do not."""
    assert decodes_ahead(SamplingParams(), feeds_a_stage=False)
    assert decodes_ahead(SamplingParams(structured=SCHEMA), feeds_a_stage=False)
    assert decodes_ahead(SamplingParams(structured=TOOL, seed=1), feeds_a_stage=False)
    assert not decodes_ahead(SamplingParams(structured=SCHEMA, presence_penalty=0.5), feeds_a_stage=False)
    assert not decodes_ahead(SamplingParams(structured=SCHEMA), feeds_a_stage=True)


def test_a_constrained_request_is_in_flight_ahead(ahead):
    """Once it decodes, a constrained request's step is launched before the last one's token is read back:
    a step is in flight after each `step()`, its token a placeholder, its grammar a token behind it."""
    engine = ahead.engine
    engine.add_request("c", engine.processor.encode(PROMPTS[1]), constrained(SCHEMA))
    seen = []
    while len(seen) < 4:  # its schema compiles first, on the grammar thread
        seen += [t for o in engine.step() for t in o.outputs[0].delta_token_ids]
    seq = engine.scheduler.get("c")
    assert engine._launched is not None and seq in engine._launched.rows
    assert seq.output_token_ids == [*seen, PLACEHOLDER]
    engine.abort("c")
    assert_idle(ahead)


def test_when_a_step_may_run_ahead():
    a, b = _seq("a", 2, 10), _seq("b", 3, 10)
    assert may_run_ahead(_scheduler([a, b]), eligible)
    assert not may_run_ahead(_scheduler([]), eligible)
    assert may_run_ahead(_scheduler([a, _seq("p", 0, 10, left=3)]), eligible)  # a prefill beside it
    assert may_run_ahead(_scheduler([a, _seq("last", 9, 10)]), eligible)  # its 10th token ends it
    assert not may_run_ahead(_scheduler([a, _seq("penalised", 2, 10, eligible=False)]), eligible)
    waiting = _scheduler([a])
    waiting.waiting.append(_seq("w", 0, 10, left=3))
    assert may_run_ahead(waiting, eligible)  # its prompt is on the host; the step judges it once admitted
    # 5 tokens each at 4 a page: the sixth needs a second page; two sequences, one page free
    crowded = _scheduler([_seq("c", 2, 10), _seq("d", 2, 10)], num_pages=3)
    assert not may_run_ahead(crowded, eligible)
    assert may_run_ahead(_scheduler([_seq("c", 2, 10), _seq("d", 2, 10)], num_pages=4), eligible)


def test_a_step_with_prompt_rows_takes_the_ids_in_flight_for_its_decode_rows():
    """The next step's ids: a prompt chunk's from the host, the decode rows of sequences sampled in the step in
    flight from its ids on the device, a decode row whose token is known from the host."""
    a, b = _seq("a", 2, 10), _seq("b", 2, 10)
    launched = _launched([a, b])
    for seq in (a, b):
        seq.output_token_ids.append(PLACEHOLDER)
    known = _seq("known", 4, 10)
    known.output_token_ids[-1] = 99
    prompt = Sequence("p", [5, 6, 7, 8, 9], 10, data=SimpleNamespace(decodes_ahead=True))
    chunks = [
        ScheduledChunk(b, b.num_tokens - 1, 1),
        ScheduledChunk(prompt, 1, 3),
        ScheduledChunk(known, known.num_tokens - 1, 1),
        ScheduledChunk(a, a.num_tokens - 1, 1),
    ]
    assert launched.input_ids(chunks).tolist() == [11, 6, 7, 8, 99, 10]
    stray = _seq("stray", 2, 10)
    stray.output_token_ids[-1] = PLACEHOLDER  # in flight in no step this one launched after
    with pytest.raises(KeyError):
        launched.input_ids([ScheduledChunk(stray, stray.num_tokens - 1, 1)] + chunks[1:2])


def test_a_prompt_sampled_ahead_gets_its_first_token_in_place():
    """A prompt's last chunk samples its first token ahead: the placeholder after it takes the id read back."""
    seq = _seq("p", 0, 10, left=3)
    chunk = ScheduledChunk(seq, seq.num_computed_tokens, 3)
    launched = Launched.start([chunk], torch.tensor([42]))
    seq.num_computed_tokens += 3
    seq.output_token_ids.append(PLACEHOLDER)
    applied = settle(launched, lambda s, token, logprobs: [(s.request_id, token)], lambda s, exc: [])
    assert applied == [("p", 42)] and seq.output_token_ids == [42]


def test_arrivals_each_step_launch_ahead_with_the_tokens_of_lockstep(lockstep, ahead, monkeypatch):
    """A request arriving on every step (a server under load), prompts prefilled in chunks beside the decode
    rows: steps with prompt rows launch ahead, and every request gets lockstep's tokens and texts."""
    arrivals = [
        (f"r{i}", PROMPTS[i % 4] * (1 + i % 3), SamplingParams(max_tokens=6 + i % 5, temperature=0.0))
        for i in range(12)
    ]
    arrivals[5] = (
        "seeded",
        PROMPTS[2],
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, ignore_eos=True),
    )

    def stream(llm):
        engine, streams, pending = llm.engine, {}, list(arrivals)
        while pending or engine.has_unfinished():
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, engine.processor.encode(prompt), params)
            for out in engine.step():
                streams.setdefault(out.request_id, []).append(out)
        return {rid: summary(outs) for rid, outs in streams.items()}

    for llm in (lockstep, ahead):
        monkeypatch.setattr(llm.engine.scheduler, "max_num_batched_tokens", 16)  # prompts in several chunks
    expected = stream(lockstep)
    with_prompts = []
    launch = ahead.engine._launch
    monkeypatch.setattr(
        ahead.engine,
        "_launch",
        lambda chunks, prev: (
            with_prompts.append(any(c.num_tokens > 1 for c in chunks)) or launch(chunks, prev)
        ),
    )
    assert stream(ahead) == expected
    assert sum(with_prompts) >= 5
    assert_idle(ahead)
    assert_idle(lockstep)


def test_requests_ending_by_length_on_every_step_still_launch_ahead(lockstep, ahead, monkeypatch):
    """Short replies arriving on every step (Qwen3-ASR under load): a request ends by length on nearly every
    step, and its last token is sampled in a step launched ahead like any other, read back into its final
    output with its logprobs (a final-only request's too); every request gets lockstep's tokens, texts and
    finish reasons."""
    reference = lockstep.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    arrivals = [
        (f"r{i}", PROMPTS[i % 4], SamplingParams(max_tokens=1 + i % 4, temperature=0.0)) for i in range(12)
    ]
    arrivals[3] = ("final", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
    arrivals[5] = ("logprobs", PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0, logprobs=2))
    # its last allowed token is a stop token: "stop", as lockstep says
    arrivals[6] = (
        "stopped",
        PROMPTS[1],
        SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[reference[2]]),
    )

    def stream(llm):
        engine, streams, pending = llm.engine, {}, list(arrivals)
        while pending or engine.has_unfinished():
            if pending:
                rid, prompt, params = pending.pop(0)
                ids = engine.processor.encode(prompt)
                engine.add_requests([NewRequest(rid, ids, params, prompt, final_only=rid == "final")])
            for out in engine.step():
                streams.setdefault(out.request_id, []).append(out)
        logprobs = streams["logprobs"][-1].outputs[0].logprobs
        return {rid: summary(outs) for rid, outs in streams.items()}, logprobs

    expected, logprobs = stream(lockstep)
    assert expected["stopped"][4] == "stop" and expected["r1"][4] == "length" and len(expected["r7"][0]) == 4
    assert len(expected["final"][0]) == 3 and len(logprobs) == 2
    launched = []
    launch = ahead.engine._launch
    monkeypatch.setattr(
        ahead.engine,
        "_launch",
        lambda chunks, prev: launched.append(prev is not None) or launch(chunks, prev),
    )
    got, got_logprobs = stream(ahead)
    assert got == expected
    for row, want in zip(got_logprobs, logprobs, strict=True):  # the last token's travel with it
        assert row.token_id == want.token_id and row.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert len(launched) >= 12 and sum(launched) >= len(launched) - 2  # all but the first and a gap at most
    assert_idle(ahead)


def test_the_next_inputs_are_the_ids_sampled_for_the_same_sequences():
    a, b, c = _seq("a", 2, 10), _seq("b", 2, 10), _seq("c", 2, 10)
    launched = _launched([a, b, c])
    assert launched.tokens() == [10, 11, 12]
    assert launched.input_ids(launched.chunks).tolist() == [10, 11, 12]
    assert launched.input_ids([ScheduledChunk(s, s.num_computed_tokens, 1) for s in (a, c)]).tolist() == [
        10,
        12,
    ]
