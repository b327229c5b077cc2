"""logprobs, logit_bias and echo through a live `omnistage serve` (tiny checkpoint, CPU) and the openai client:
chat's and completions' shapes, streamed and not, and transcriptions' include[]=logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from omnistage.models.qwen3_omni.processor import Processor
from omnistage.server.logprobs import TokenTexts
from tests.server.conftest import SHARED_MODEL

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]
FORCED = {"ignore_eos": True}  # every reply as long as asked: the tiny model ends early at random


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def model() -> str:
    return SHARED_MODEL


@pytest.fixture(scope="module")
def processor(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


def greedy_chat(client, model, max_tokens=12, **fields):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, extra_body=FORCED, **fields
    )


def test_chat_logprobs_at_temperature_0_are_the_top_ones_and_stream_alike(client, model):
    whole = greedy_chat(client, model, logprobs=True, top_logprobs=5)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 5
        top = entry.top_logprobs[0]
        assert (top.token, top.logprob, top.bytes) == (entry.token, entry.logprob, entry.bytes)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)

    chunks = list(greedy_chat(client, model, logprobs=True, top_logprobs=5, stream=True))
    streamed = [
        entry
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )

    # logprobs alone: the sampled token's, no alternatives; no logprobs: none, as before
    alone = greedy_chat(client, model, logprobs=True).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in alone] == [(e.token, e.logprob) for e in content]
    assert all(e.top_logprobs == [] for e in alone)
    assert greedy_chat(client, model).choices[0].logprobs is None


def test_chat_logprobs_bytes_spell_the_reply(client, model):
    """The tokens' bytes joined are the reply's bytes (the tiny model's end tokens have no text of their own)."""
    whole = greedy_chat(client, model, logprobs=True, max_tokens=24)
    content = whole.choices[0].logprobs.content
    spelled = b"".join(
        bytes(e.bytes) for e in content if not (e.token.startswith("<|") and e.token.endswith("|>"))
    )
    assert spelled.decode("utf-8", errors="replace") == whole.choices[0].message.content


def test_sampled_rows_get_their_sampled_tokens_logprobs(client, model):
    sampled = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
        extra_body=FORCED,
    )  # fmt: skip
    again = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
        extra_body=FORCED,
    )  # fmt: skip
    content = sampled.choices[0].logprobs.content
    assert [e.model_dump() for e in content] == [e.model_dump() for e in again.choices[0].logprobs.content]
    for entry in content:  # the sampled token's logprob is its own, whatever its rank
        listed = {t.token: t.logprob for t in entry.top_logprobs}
        assert entry.token not in listed or listed[entry.token] == entry.logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob


def test_logit_bias_forces_and_bans_tokens(client, model, processor):
    forced = client.completions.create(
        model=model,
        prompt="The river",
        max_tokens=5,
        temperature=0,
        logit_bias={"42": 100},
        extra_body=FORCED,
    )
    assert forced.choices[0].text == processor.decode([42] * 5)

    first = greedy_chat(client, model, logprobs=True, max_tokens=1).choices[0].logprobs.content[0]
    texts = TokenTexts(processor.tokenizer)
    favourite = next(
        i for i in range(processor.tokenizer.get_vocab_size()) if texts.bytes_of(i) == bytes(first.bytes)
    )
    banned = greedy_chat(
        client, model, logprobs=True, top_logprobs=2, max_tokens=1, logit_bias={str(favourite): -100}
    )
    entry = banned.choices[0].logprobs.content[0]
    # the model's second choice is drawn; logprobs are the model's, before the bias
    assert entry.token != first.token
    assert (entry.token, entry.logprob) == (entry.top_logprobs[1].token, entry.top_logprobs[1].logprob)
    assert entry.top_logprobs[0].token == first.token


@pytest.mark.parametrize(
    ("bias", "needle"),
    [
        ({"abc": 1}, "keys must be token ids"),
        ({"-3": 1}, "keys must be token ids"),
        ({"999999999": 1}, "outside the vocabulary"),
        ({"42": 150}, "must be in [-100, 100]"),
    ],
)
def test_bad_logit_bias_is_400_naming_it(client, model, bias, needle):
    for create in (
        lambda: greedy_chat(client, model, logit_bias=bias),
        lambda: client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias=bias),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            create()
        assert needle in error.value.message and error.value.param == "logit_bias"


def test_completions_logprobs_legacy_shape_streamed_and_not(client, model):
    def create(**fields):
        return client.completions.create(
            model=model, prompt="The quick brown fox", max_tokens=10, temperature=0, logprobs=3,
            extra_body=FORCED, **fields,
        )  # fmt: skip

    whole = create()
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    offset = 0
    for token, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset
        offset += len(token)
        assert 1 <= len(top) <= 4 and top[token] == logprob == max(top.values())

    chunks = list(create(stream=True))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in pieces for x in getattr(p, name)] == getattr(lp, name)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_completions_echo_streamed_and_not(client, model, processor):
    prompt = "The quick brown fox"
    plain = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body=FORCED
    )
    echoed = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, extra_body=FORCED
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage == plain.usage
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True, extra_body=FORCED
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = processor.encode("<|im_start|>user\nhi")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith("<|im_start|>user\nhi")

    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    assert error.value.param == "echo" and "prompt's logprobs" in error.value.message


def test_chat_logprobs_bounds_are_400(client, model):
    for fields, param in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            greedy_chat(client, model, **fields)
        assert error.value.param == param


def test_transcription_include_logprobs(client, model, server):
    def transcribe(**fields):
        return client.audio.transcriptions.create(
            file=SPEECH.open("rb"), model=model, include=["logprobs"], temperature=0,
            extra_body={"max_tokens": 6, "ignore_eos": True}, **fields,
        )  # fmt: skip

    result = transcribe()
    assert len(result.logprobs) == 6
    for entry in result.logprobs:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and isinstance(entry.bytes, list)
    without = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=model, temperature=0, extra_body={"max_tokens": 6, "ignore_eos": True}
    )
    assert without.text == result.text and without.logprobs is None

    # streamed: the delta events carry their tokens' logprobs, the done event all of them
    with httpx.stream(
        "POST",
        f"{server.url}/v1/audio/transcriptions",
        data={
            "model": model,
            "include[]": "logprobs",
            "stream": "true",
            "max_tokens": "6",
            "ignore_eos": "true",
        },
        files={"file": ("speech.wav", SPEECH.read_bytes(), "audio/wav")},
        timeout=60,
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    done = events[-1]
    assert done["type"] == "transcript.text.done"
    # the same clip again: its prompt now comes from the prefix cache, computed in other chunks, so the
    # logprobs agree to float rounding, the tokens exactly
    whole = [e.model_dump() for e in result.logprobs]
    assert [(e["token"], e["bytes"]) for e in done["logprobs"]] == [(e["token"], e["bytes"]) for e in whole]
    assert [e["logprob"] for e in done["logprobs"]] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)
    deltas = [entry for e in events[:-1] for entry in e["logprobs"]]
    assert deltas == done["logprobs"][: len(deltas)]

    with pytest.raises(openai.BadRequestError) as error:
        transcribe(response_format="text")
    assert error.value.param == "include[]"
