"""Constrained decoding (omnistage/engine/structured.py) on the tiny checkpoint's random weights: whatever the
weights, every output is a whole sentence of its grammar, and no step samples a token its mask forbids."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from omnistage.engine.sampling import Sampler, SamplingRow
from omnistage.engine.structured import CACHE_SIZE, Grammars, InvalidConstraint, allocate_bitmask, check
from omnistage.llm import LLM
from omnistage.request import SamplingParams, StructuredOutput, ToolSchema

MAX_TOKENS = 1000  # far above what the bounded schemas below need: the grammar, not the length, ends each


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", num_kv_pages=512, decode_ahead=True)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of objects, arrays, enums, strings, numbers and booleans, nested; strings and arrays are
    bounded so that random weights finish them within MAX_TOKENS."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + ["object", "array"] * (depth < 2)
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 10**6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "é", 3, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "object":
        names = rng.sample(["name", "age", "tags", "x", "nested", "ok", "id"], rng.randint(1, 4))
        properties = {name: random_schema(rng, depth + 1) for name in names}
        required = [n for n in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
    return {"type": kind}


def replay_allowed(grammars: Grammars, structured: StructuredOutput, token_ids: list[int]) -> None:
    """Each of `token_ids` was allowed by its grammar's mask at its step (checked afresh, token by token)."""
    state = grammars.state(structured)
    bitmask = allocate_bitmask(1, grammars.vocab_size)
    for token in token_ids:
        state.fill(bitmask, 0)
        assert (bitmask[0, token // 32] >> (token % 32)) & 1, f"token {token} was masked"
        state.accept(token)
    assert state.done


def test_random_schemas_give_json_that_validates(llm, monkeypatch):
    """Decoding ahead, each step's masks filled after the token before is read back: still every token allowed."""
    launched = []
    launch = llm.engine._launch
    monkeypatch.setattr(
        llm.engine, "_launch", lambda chunks, prev: launched.append(len(chunks)) or launch(chunks, prev)
    )
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"root": random_schema(rng)}, "required": ["root"]}]
    schemas += [random_schema(rng) for _ in range(11)]
    constraints = [StructuredOutput(json_schema=json.dumps(s)) for s in schemas]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured=c)
        for seed, c in enumerate(constraints)
    ]
    outputs = llm.generate(["Give me some JSON."] * len(params), params)
    grammars = llm.engine.constraints.grammars
    for schema, constraint, out in zip(schemas, constraints, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
        replay_allowed(grammars, constraint, completion.token_ids)
    assert len(launched) >= 20 and max(launched) >= 4  # the constrained batch decoded ahead


def test_constrained_and_free_rows_in_one_batch(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = StructuredOutput(json_schema=json.dumps(schema))
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, structured=structured)
    free = SamplingParams(max_tokens=8, temperature=0.0)
    alone = llm.generate("Hi", free)[0].outputs[0].token_ids
    outs = llm.generate(["Hi", "Hi", "Hi"], [constrained, free, constrained])
    for out in (outs[0], outs[2]):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert outs[1].outputs[0].token_ids == alone  # the free row is untouched by its neighbours' masks


def test_json_object_takes_any_object_and_nothing_else(llm):
    # Unbounded, so sampled by random weights it may not close within any length: checked on the grammar.
    for text, whole in [('{"a": [1, {"b": null}], "c": "d"}', True), ("[1]", False), ('"x"', False)]:
        state = llm.engine.constraints.state(StructuredOutput(json_object=True))
        assert state.matcher.accept_string(text) == whole and state.done == whole


WEATHER = ToolSchema(
    "get_weather",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    ),
)
CLOCK = ToolSchema(
    "get_time", json.dumps({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}})
)


CALL = "<tool_call>\n(.*?)\n</tool_call>"


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_calls_follow_qwens_format(llm, parallel):
    structured = StructuredOutput(tools=(WEATHER, CLOCK), parallel_tool_calls=parallel)
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            skip_special_tokens=False,
            structured=structured,
        )
        for seed in range(2)
    ]
    tools = {t.name: json.loads(t.parameters) for t in (WEATHER, CLOCK)}
    for out in llm.generate(["What is the weather?"] * len(params), params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert re.fullmatch(f"{CALL}(\n{CALL})*", completion.text, re.DOTALL), completion.text
        calls = [json.loads(body) for body in re.findall(CALL, completion.text, re.DOTALL)]
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            assert set(call) == {"name", "arguments"}
            jsonschema.validate(call["arguments"], tools[call["name"]])


BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("structured", "opening"),
    [
        (StructuredOutput(tools=(WEATHER,)), '<tool_call>\n{"name": "get_weather", "arguments": {"city":"'),
        (StructuredOutput(json_schema=json.dumps(BOUNDED)), '{"city": "'),
    ],
)
@pytest.mark.parametrize("value", ["<<\tcardﻋ", "' לחבר際\x1c", "\x00", "a\x1fb"])
def test_a_length_bounded_string_takes_no_control_character(llm, structured, opening, value):
    """JSON has a control character in a string only escaped: written raw, the object is no JSON (a forced
    tool call whose arguments held a tab came back as the reply's text)."""
    refused = llm.engine.constraints.state(structured)
    assert refused.matcher.accept_string(opening)
    assert not refused.matcher.accept_string(value)
    accepted = llm.engine.constraints.state(structured)
    assert accepted.matcher.accept_string(opening + "".join(c for c in value if c >= " ") + '"')


def test_a_length_bounded_string_argument_parses_whatever_the_draw(llm):
    """Seeds whose draws, the grammar letting them, put a tab (24) or U+001C (72) into the city."""
    structured = StructuredOutput(tools=(WEATHER,), parallel_tool_calls=False)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured=structured)
        for seed in (24, 72)
    ]
    for out in llm.generate(["What is the weather?"] * len(params), params):
        (body,) = re.findall(CALL, out.outputs[0].text, re.DOTALL)
        jsonschema.validate(json.loads(body)["arguments"], BOUNDED)


NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}


@pytest.mark.parametrize(
    ("structured", "opening"),
    [
        (
            StructuredOutput(tools=(ToolSchema("take_note", json.dumps(NOTE)),)),
            '<tool_call>\n{"name": "take_note", "arguments": {"note":"',
        ),
        (StructuredOutput(json_schema=json.dumps(NOTE)), '{"note": "'),
        (StructuredOutput(json_object=True), '{"'),  # a key
        (StructuredOutput(json_object=True), '{"k": "'),
    ],
)
def test_no_escape_writes_a_lone_surrogate(llm, structured, opening):
    """JSON lets `\\ud800` stand alone, which decodes to no valid Unicode: pydantic's parser refuses it, and a
    str holding it cannot be encoded as UTF-8."""
    for lone in ['\\ud800"', "\\uDBFF\\u0041", "\\ud800x", "\\udc00", "\\uDFFF"]:
        state = llm.engine.constraints.state(structured)
        assert state.matcher.accept_string(opening)
        assert not state.matcher.accept_string(lone), lone
    for scalar in [
        "\\ud83d\\ude00",
        "\\uDBFF\\uDFFF",
        "\\uD800\\udc00",
        "\\u00e9",
        "\\uD7FF",
        "\\uE000",
        "\\uffff",
    ]:
        state = llm.engine.constraints.state(structured)
        assert state.matcher.accept_string(opening + scalar + "x" + scalar + '"'), scalar


def test_padded_and_special_columns_are_always_masked(llm):
    grammars = llm.engine.constraints.grammars
    state = grammars.state(StructuredOutput(grammar='root ::= [^"]*'))
    bitmask = allocate_bitmask(1, grammars.vocab_size)
    state.fill(bitmask, 0)
    allowed = torch.zeros(1, grammars.vocab_size)
    xgr.apply_token_bitmask_inplace(allowed, bitmask)
    tokenizer = llm.engine.tokenizer
    assert grammars.vocab_size > tokenizer.get_vocab_size()  # the checkpoint pads its vocabulary
    assert torch.isinf(allowed[0, tokenizer.get_vocab_size() :]).all()
    assert torch.isinf(allowed[0, tokenizer.token_to_id("<|im_start|>")])
    assert not torch.isinf(allowed[0, tokenizer.token_to_id("hello")])


def test_sampler_never_draws_a_masked_token(llm):
    grammars = llm.engine.constraints.grammars
    structured = StructuredOutput(json_schema=json.dumps({"enum": ["yes", "no"]}))
    logits = torch.randn(4, grammars.vocab_size)
    logits[:, tokenizer_id(llm, "maybe")] = 1e4  # what the weights want most is forbidden
    rows = [
        SamplingRow(SamplingParams(temperature=t), [], [], grammar=grammars.state(structured))
        for t in (0.0, 1.0)
    ] + [SamplingRow(SamplingParams(temperature=0.0), [], []) for _ in range(2)]
    sampled = Sampler()(logits, rows).tolist()
    for token in sampled[:2]:
        text = llm.engine.tokenizer.decode([token])
        assert text and ('"yes"'.startswith(text) or '"no"'.startswith(text)), text
    assert sampled[2:] == [tokenizer_id(llm, "maybe")] * 2


def tokenizer_id(llm, text: str) -> int:
    return llm.engine.tokenizer.token_to_id(text)


def test_refused_constraints_name_their_field(llm):
    with pytest.raises(InvalidConstraint) as err:
        check(StructuredOutput(json_schema='{"type": "nonsense"}'))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidConstraint) as err:
        check(StructuredOutput(tools=(ToolSchema("f", "{not json"),)))
    assert err.value.param == "tools"
    with pytest.raises(InvalidConstraint) as err:  # at admission too, for a caller that skipped the edge
        llm.generate("Hi", SamplingParams(structured=StructuredOutput(grammar="root ::= undefined_rule")))
    assert err.value.param == "grammar"
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_the_cache_is_bounded(llm):
    grammars = llm.engine.constraints.grammars
    for i in range(CACHE_SIZE + 3):
        grammars.compile(StructuredOutput(json_schema=json.dumps({"const": i})))
    assert len(grammars._cache) == CACHE_SIZE


def fresh_constraint(tag: str) -> StructuredOutput:
    """A schema no earlier test compiled."""
    schema = {"type": "object", "properties": {tag: {"type": "boolean"}}, "required": [tag]}
    return StructuredOutput(json_schema=json.dumps(schema))


def test_a_new_constraint_compiles_beside_the_other_requests_steps(llm):
    engine, prompt = llm.engine, llm.engine.tokenizer.encode("Hi").ids
    engine.add_request("free", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    structured = fresh_constraint("beside")
    engine.add_request(
        "constrained", prompt, SamplingParams(max_tokens=MAX_TOKENS, seed=1, structured=structured)
    )
    assert len(engine.constraints.compiling) == 1  # admitted without waiting for its compile
    # the free request's steps go on meanwhile (decoding ahead, a step's tokens come out of the next)
    assert "free" in {o.request_id for _ in range(2) for o in engine.step()}
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["free"].outputs[0].finish_reason == "length"
    assert json.loads(final["constrained"].outputs[0].text).keys() == {"beside"}
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_request_aborted_while_its_constraint_compiles_leaves_nothing(llm):
    engine, prompt = llm.engine, llm.engine.tokenizer.encode("Hi").ids
    engine.add_request("gone", prompt, SamplingParams(max_tokens=50, structured=fresh_constraint("gone")))
    assert engine.abort("gone") is None
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_pages
