"""Text that cannot fit the context is refused by its size before it is tokenized, and tokenizing a large
prompt leaves the event loop free (/health answers meanwhile). In-process over the real tiny engine."""

from __future__ import annotations

import asyncio
import random
import re
import time
import unicodedata
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from tokenizers import normalizers

from omnistage.config import engine_config
from omnistage.errors import RequestTooLarge
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app

MODEL = "tiny"
BODY_LIMIT = 64 * 1024 * 1024


def words(size: int, seed: int = 0) -> str:
    """`size` characters of random lowercase words: about two characters per token, no tokenizer cache luck."""
    rng = random.Random(seed)
    vocabulary = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 12))) for _ in range(20000)
    ]
    text = " ".join(rng.choices(vocabulary, k=size // 6))
    return (text * (size // len(text) + 1))[:size]


@pytest.fixture(scope="module")
def whole_context(tiny_checkpoint) -> Iterator[AsyncPipeline]:
    """The real engine over the tiny checkpoint on the CPU with pages for its whole context (65,536 tokens)."""
    engine = AsyncPipeline.from_config(
        engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=65536 // 16)
    )
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def app(whole_context):
    return build_app(whole_context, MODEL, max_body_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
def oversized(whole_context) -> str:
    limit = whole_context.pipeline.max_model_len * whole_context.pipeline.processor.max_token_bytes
    return words(limit + 1)


@pytest.mark.parametrize("endpoint", ["chat", "completions", "chat-parts"])
def test_text_too_long_for_the_context_is_refused_before_tokenizing(app, whole_context, oversized, endpoint):
    body = {
        "chat": {"messages": [{"role": "user", "content": oversized}]},
        "completions": {"prompt": oversized},
        "chat-parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": oversized}]}]},
    }[endpoint]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    started = time.monotonic()
    r = TestClient(app).post(path, json={"model": MODEL, "max_tokens": 1} | body)
    elapsed = time.monotonic() - started
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    context = whole_context.pipeline.max_model_len
    assert error["code"] == "request_too_large"
    assert f"the model's context of {context:,} tokens holds at most" in error["message"], error
    size = re.match(r"the prompt is ([\d,]+) bytes of text;", error["message"])
    assert size and int(size[1].replace(",", "")) >= len(oversized)
    # Tokenizing these 8 MiB would take many seconds on a CPU; reading and measuring them takes little.
    assert elapsed < 5, elapsed


def test_a_prompt_over_the_context_in_tokens_is_refused_with_its_count(app):
    text = words(400_000)  # under the byte bound, over 65,536 tokens
    r = TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "tokens; the model's context is 65,536 tokens" in r.json()["error"]["message"]


def test_health_answers_while_a_large_prompt_is_tokenized(app):
    text = words(3_000_000)  # within the byte bound, so it is tokenized (for a few CPU seconds)

    async def scenario() -> tuple[float, list[float], httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            started = time.monotonic()
            big = asyncio.create_task(
                client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
            )
            gaps, last = [], time.monotonic()  # between answers to /health probes sent every 20 ms
            while not big.done():
                assert (await client.get("/health")).status_code == 200
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                await asyncio.sleep(0.02)
            return time.monotonic() - started, gaps, await big

    took, gaps, response = asyncio.run(scenario())
    assert response.status_code == 400 and "tokens; the model's context is" in response.text
    assert took > 0.5, took  # long enough for the probes to overlap the tokenizing
    assert max(gaps) < 0.5, (
        f"/health went unanswered for {max(gaps):.2f} s during a {took:.2f} s tokenization"
    )


def test_the_byte_bound_measures_text_as_the_tokenizer_normalizes_it(tiny_checkpoint):
    processor = Processor(tiny_checkpoint)
    processor.tokenizer.normalizer = normalizers.NFC()  # as the released Qwen tokenizer has it
    context = 10
    limit = context * processor.max_token_bytes
    # Decomposed Hangul: three 3-byte jamo per syllable, which NFC composes into one 3-byte syllable.
    jamo = unicodedata.normalize("NFD", "한") * (limit // 9 + 1)
    assert len(jamo.encode()) > limit >= len(unicodedata.normalize("NFC", jamo).encode())
    with pytest.raises(RequestTooLarge, match="tokens; the model's context is 10 tokens"):
        processor.encode(jamo, max_model_len=context)  # under the bound once normalized: counted in tokens
    with pytest.raises(RequestTooLarge, match=f"the prompt is {limit + 1:,} bytes of text"):
        processor.encode("a" * (limit + 1), max_model_len=context)
    assert processor.encode("a b", max_model_len=context) == processor.tokenizer.encode("a b").ids


def test_longest_token_bytes_of_the_qwen_vocabulary(tiny_checkpoint):
    processor = Processor(tiny_checkpoint)
    assert processor.max_token_bytes == 128  # 128 spaces: the longest token of Qwen's byte-level BPE
    longest = max(processor.tokenizer.get_vocab(), key=len)
    assert processor.decode([processor.tokenizer.token_to_id(longest)]) == " " * 128


def test_the_context_advertised_is_what_the_pool_holds(tiny_pipeline):
    # the tiny model's context is 65,536 tokens, its 64 pages of 16 hold 1,024: /v1/models says what one
    # request can have, and text is measured against it
    pipeline = tiny_pipeline.pipeline
    assert pipeline.max_model_len == 64 * 16 < pipeline.thinker.max_model_len
    (card,) = TestClient(build_app(tiny_pipeline, MODEL)).get("/v1/models").json()["data"]
    assert card["max_model_len"] == 64 * 16
