"""Several choices in one answer through a live `omnistage serve` (tiny checkpoint, CPU) and the openai client:
`n` (seeded: reproducible and distinct), streamed with its indices, `best_of` keeping the most likely samples,
a list of prompts (and LangChain's `OpenAI.batch()`, which sends one), `continuous_usage_stats`, the bounds
and admission of n, and a client that leaves aborting every sample."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest
from langchain_openai import OpenAI

from tests.server.conftest import SHARED_MODEL

MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]
FORCED = {"ignore_eos": True}  # every reply as long as asked: the tiny model ends early at random
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def model() -> str:
    return SHARED_MODEL


def sampled_chat(client, model, **fields):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, extra_body=FORCED, **fields
    )


def test_n_with_a_seed_is_reproducible_distinct_and_counted_once(client, model):
    reply = sampled_chat(client, model, n=3, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 3, texts
    assert [c.message.content for c in sampled_chat(client, model, n=3, seed=7).choices] == texts
    one = sampled_chat(client, model, seed=7)
    assert one.choices[0].message.content == texts[0]  # the first sample draws under the seed itself
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * 6
    assert reply.usage.total_tokens == one.usage.prompt_tokens + 18


def test_each_choice_carries_its_own_logprobs(client, model):
    reply = sampled_chat(client, model, n=2, seed=4, logprobs=True)
    assert [len(c.logprobs.content) for c in reply.choices] == [6, 6]
    assert reply.choices[0].logprobs != reply.choices[1].logprobs


def test_n_streamed_gives_each_choice_its_index_and_the_same_texts(client, model):
    whole = sampled_chat(client, model, n=3, seed=11)
    chunks = list(
        sampled_chat(client, model, n=3, seed=11, stream=True, stream_options={"include_usage": True})
    )
    texts, finished = defaultdict(str), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_completions_streamed_and_whole_agree(client, model):
    fields = dict(model=model, prompt=PROMPTS[0], max_tokens=5, n=2, seed=3, extra_body=FORCED)
    whole = client.completions.create(**fields)
    texts = defaultdict(str)
    for chunk in client.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and texts[0] != texts[1]


def test_best_of_keeps_the_most_likely_samples(client, model):
    fields = dict(model=model, prompt=PROMPTS[0], max_tokens=5, seed=5, logprobs=0, extra_body=FORCED)
    # the same four samples (seeded alike), all of them and the best two
    every = client.completions.create(**fields, n=4)
    best = client.completions.create(**fields, n=2, best_of=4)
    likelihood = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    assert len(likelihood) == 4
    ranked = sorted(likelihood, key=likelihood.__getitem__, reverse=True)
    assert [c.text for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    for choice in best.choices:
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(likelihood[choice.text])
    assert (
        best.usage.completion_tokens == every.usage.completion_tokens == 4 * 5
    )  # every sample was generated
    without_logprobs = client.completions.create(**(fields | {"logprobs": None}), n=2, best_of=4)
    assert [c.text for c in without_logprobs.choices] == ranked[:2]
    assert all(c.logprobs is None for c in without_logprobs.choices)


def test_best_of_refusals_name_it(client, model):
    for extra in ({"best_of": 3, "stream": True}, {"best_of": 1, "n": 2}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt="a", max_tokens=2, **extra)
        assert refused.value.body["param"] == "best_of", refused.value.body


def test_a_list_of_prompts_is_answered_prompt_major(client, model):
    fields = dict(model=model, max_tokens=4, temperature=0, extra_body=FORCED)
    alone = [client.completions.create(prompt=p, **fields) for p in PROMPTS]
    together = client.completions.create(prompt=PROMPTS, n=2, **fields)
    assert [c.index for c in together.choices] == [0, 1, 2, 3]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == 4 * 4
    ids = [[1, 2], [3, 4, 5]]
    by_ids = client.completions.create(prompt=ids, **fields)
    assert by_ids.usage.prompt_tokens == 5 and len(by_ids.choices) == 2
    texts = defaultdict(str)
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [a.choices[0].text for a in alone]


def test_langchain_batch_gets_one_answer_per_prompt(server, model, client):
    llm = OpenAI(
        model=model, base_url=f"{server.url}/v1", api_key="none", max_tokens=4, temperature=0, max_retries=0
    )
    answers = llm.batch([*PROMPTS, "Hello"])
    expected = [
        client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in [*PROMPTS, "Hello"]
    ]
    assert answers == expected


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_rides_on_every_chunk(client, model, n):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(sampled_chat(client, model, n=n, seed=1, stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == n * 6
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    streamed = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=3, stream=True, stream_options=options, extra_body=FORCED
    )
    counts = [c.usage.completion_tokens for c in streamed]
    assert counts == sorted(counts) and counts[-1] == 3 and len(counts) >= 2  # tokens may share a chunk


def test_n_bounds_and_admission(client, model):
    cases = [
        ({"n": 17}, "n", "between 1 and 16"),
        (
            {"n": 2, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}},
            "n",
            "spoken",
        ),
    ]
    for fields, param, needle in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **fields)
        assert refused.value.body["param"] == param and needle in refused.value.body["message"]
    # 64 pages of 16 tokens: 16 samples of prompt + 200 tokens (13 pages each) cannot run together, 2 can
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, n=16)
    assert refused.value.body["code"] == "request_too_large", refused.value.body
    assert len(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, n=2).choices) == 2
    # without max_tokens, each sample's default is cut to its share of the pool: 4 pages, 64 tokens
    shared = client.chat.completions.create(model=model, messages=MESSAGES, n=16)
    assert len(shared.choices) == 16
    assert shared.usage.completion_tokens <= 16 * (64 - shared.usage.prompt_tokens)


def test_a_client_that_leaves_aborts_every_sample(server, model):
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 300,
        "n": 3,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    server.wait_pages_free(timeout=10)
