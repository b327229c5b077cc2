"""A live `omnistage serve` (tiny checkpoint, CPU) driven by the official openai client, as users drive it."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import openai
import pytest

from omnistage.models.qwen3_omni.processor import Processor

API_KEY = "sk-omnistage-test"
NUM_KV_PAGES = 128  # x 16 tokens = 2,048 tokens: one request of the whole context (the least a pool may hold)
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 1_000_000

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers in Europe."},
]


@pytest.fixture(scope="module")
def server(launch_server):
    with launch_server(
        "server",
        "--page-size", "16",
        "--num-kv-pages", str(NUM_KV_PAGES),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--api-key", API_KEY,
        "--max-body-bytes", str(MAX_BODY_BYTES),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module", autouse=True)
def queue_server_process(launch_server):
    """One sequence runs at a time and one may wait: a third concurrent request is refused. Started with the
    module (its start overlaps the other server's and the tests before its one user), waited for by its user."""
    with launch_server(
        "queue-server", "--num-kv-pages", "64", "--max-model-len", "1024", "--max-num-seqs", "1",
        "--max-queue", "1", "--served-model-name", "queued", ready=False,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def queue_server(queue_server_process):
    return queue_server_process.wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def processor(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


def test_models_lists_the_served_name(client, model, tiny_checkpoint):
    (card,) = client.models.list().data
    assert card.id == model
    assert client.models.retrieve(model).id == model


def test_chat_stream_equals_non_stream_for_greedy(client, model, processor):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    prompt_ids = processor.encode(processor.render_chat(MESSAGES))
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == len(prompt_ids) + 24
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_string_and_token_ids(client, model, processor):
    prompt = "The quick brown fox"
    by_text = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    ids = processor.encode(prompt)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 12
    assert by_text.choices[0].finish_reason == "length"

    streamed = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == by_text.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproduces_sampling(client, model):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"top_k": 50},
        )
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_string_cuts_the_text(client, model):
    prompt = "Once upon a time"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 :].strip()[:3]
    assert stop, full
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    text = chat.choices[0].message.content
    stop = text[len(text) // 2 :].strip()[:2]
    cut = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=0, stop=stop
    )
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (
        text[: text.index(stop)],
        "stop",
    )


# -- errors -----------------------------------------------------------------------------------------------


def test_invalid_field_is_400_with_its_path(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature="hot")
    assert info.value.status_code == 400
    assert "temperature: Input should be a valid number" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "hi"}])
    assert "messages[0].role" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, n=17)
    assert "n must be between 1 and 16" in info.value.message


def test_over_the_context_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[100] * 2100, max_tokens=10)
    assert "the prompt has 2,100 tokens; the model's context is 2,048 tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[100] * 10, max_tokens=5000)
    assert "exceeds the model's context of 2,048 tokens" in info.value.message


def test_missing_or_wrong_key_is_401(server, model):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=model, messages=MESSAGES)
    assert info.value.status_code == 401 and "missing or invalid API key" in info.value.message
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.status_code == 404 and "the model 'gpt-4o' does not exist" in info.value.message


def test_body_over_the_limit_is_413(server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 413
    assert "the limit is 1,000,000 bytes" in r.json()["error"]["message"]


def test_queue_full_is_503_and_a_queued_client_can_leave(queue_server):
    client = openai.OpenAI(base_url=f"{queue_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    running = client.chat.completions.create(model="queued", messages=MESSAGES, max_tokens=1000, stream=True)
    next(iter(running))  # its first chunk: it runs, alone (--max-num-seqs 1), for several seconds

    outcome: list[object] = []

    def wait_in_queue() -> None:  # queued behind `running`, it gives up after 1.5 s
        body = {"model": "queued", "messages": MESSAGES, "max_tokens": 4}
        try:
            outcome.append(httpx.post(f"{queue_server.url}/v1/chat/completions", json=body, timeout=1.5))
        except httpx.ReadTimeout as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=wait_in_queue)
    waiting.start()
    deadline = time.monotonic() + 10
    while queue_server.metrics()["omnistage_num_requests_waiting"] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.01)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="queued", messages=MESSAGES, max_tokens=4)
    assert info.value.status_code == 503
    assert "queue is full (1 requests waiting, the limit is 1)" in info.value.message

    waiting.join()
    assert isinstance(outcome[0], httpx.ReadTimeout), outcome
    time.sleep(0.2)
    m = queue_server.metrics()
    assert (m["omnistage_num_requests_waiting"], m["omnistage_num_requests_running"]) == (0, 1)
    running.close()
    queue_server.wait_pages_free(timeout=1.0)


# -- load and disconnects -----------------------------------------------------------------------------------


def test_32_concurrent_streams_complete_and_free_every_page(server, model):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Request number {i}: count to {i}."}],
            max_tokens=40,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    # 32 requests of ~55 tokens need ~128 pages at their longest: more than the pool's 64, so some wait.
    results = asyncio.run(all_of_them())
    assert results == [("length", 40)] * 32
    server.wait_pages_free(timeout=2)
    m = server.metrics()
    assert m["omnistage_kv_pages_free"] == NUM_KV_PAGES
    assert m["omnistage_num_requests_running"] == m["omnistage_num_requests_waiting"] == 0
    assert m["omnistage_builds_while_serving"] == 0  # the CPU compiles nothing: the gauge is there, and right
    # every prompt was looked up in the prefix cache at its admission
    assert m["omnistage_prefix_cache_queries_total"] >= 32 * 10
    text = server.metrics_text()
    assert re.search(
        r'omnistage_requests_total\{endpoint="/v1/chat/completions",status="200"\} ([0-9.]+)', text
    )
    assert float(re.search(r"omnistage_time_to_first_token_seconds_count ([0-9.]+)", text)[1]) >= 32
    assert float(re.search(r"omnistage_generation_tokens_total ([0-9.]+)", text)[1]) >= 32 * 40


def test_client_leaving_mid_stream_frees_its_pages(server, client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=900, stream=True)
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    assert server.metrics()["omnistage_kv_pages_used"] > 0
    stream.close()
    assert server.wait_pages_free(timeout=1.0) < 1.0
    assert 'status="cancelled"' in server.metrics_text()


def test_client_leaving_non_stream_frees_its_pages(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 900}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=0.5)
    assert server.wait_pages_free(timeout=1.0) < 1.0
    # The server goes on serving.
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"max_tokens": 2}, headers=headers)
    assert r.status_code == 200


def test_text_content_parts_render_like_a_string(client, model):
    parts = [{"type": "text", "text": "Name three rivers"}, {"type": "text", "text": " in Europe."}]
    as_parts = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    as_string = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three rivers in Europe."}],
        max_tokens=8,
        temperature=0,
    )
    assert as_parts.usage == as_string.usage
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_a_chats_second_turn_finds_the_first_turns_pages_cached(server, client, model):
    """The second turn of a chat (the first's messages, its answer and a new message) prefills only what the
    first did not: /metrics counts the first turn's full pages as hits."""
    messages = [
        {"role": "system", "content": "You answer in one line, and you always name your source first."},
        {"role": "user", "content": "Which river is the longest in Europe, and which the second longest?"},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0)
    before = server.metrics()
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in Asia?"}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0)
    after = server.metrics()
    found = after["omnistage_prefix_cache_hits_total"] - before["omnistage_prefix_cache_hits_total"]
    assert found >= first.usage.prompt_tokens // 16 * 16 - 16  # pages of 16: all but the last partial
    assert found > 0
    server.wait_pages_free(timeout=2)
