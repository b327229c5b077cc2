"""Logprobs as OpenAI spells them: tokens' exact bytes, and the legacy completions lists across chunks."""

import math

import pytest

from omnistage.models.qwen3_omni.processor import Processor
from omnistage.outputs import TokenLogprobs
from omnistage.server.logprobs import LOGPROB_FLOOR, CompletionLogprobsWriter, TokenTexts, chat_logprobs


@pytest.fixture(scope="module")
def processor(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


@pytest.mark.parametrize("text", ["Hello, world!", "你好，世界", "café ☕ 🙂\n\tend", "  spaced\r\n"])
def test_the_tokens_bytes_join_into_the_texts_bytes(processor, text):
    texts = TokenTexts(processor.tokenizer)
    ids = processor.tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(texts.bytes_of(i) for i in ids) == text.encode()
    for i in ids:  # a token's text is its bytes read as UTF-8, a piece of a character as U+FFFD
        assert texts.text(i) == texts.bytes_of(i).decode("utf-8", errors="replace")


def test_control_tokens_read_as_written(processor):
    texts = TokenTexts(processor.tokenizer)
    im_end = processor.tokenizer.token_to_id("<|im_end|>")
    assert texts.text(im_end) == "<|im_end|>" and texts.bytes_of(im_end) == b"<|im_end|>"


def test_legacy_lists_count_offsets_across_chunks_and_floor_what_json_cannot_carry(processor):
    texts = TokenTexts(processor.tokenizer)
    a, b = processor.tokenizer.encode("Hello world", add_special_tokens=False).ids
    writer = CompletionLogprobsWriter(texts, offset=3)
    first = writer.write([TokenLogprobs(a, -0.5, ((b, -0.25), (a, -0.5)))])
    second = writer.write([TokenLogprobs(b, -math.inf, ((a, -1.0),))])
    assert first.tokens == ["Hello"] and first.text_offset == [3]
    assert first.top_logprobs == [{" world": -0.25, "Hello": -0.5}]
    assert second.text_offset == [3 + len("Hello")]
    # the sampled token is listed beside the top ones (logprobs + 1 at most), and -inf is floored
    assert second.token_logprobs == [LOGPROB_FLOOR]
    assert second.top_logprobs == [{"Hello": -1.0, " world": LOGPROB_FLOOR}]
    content = chat_logprobs(texts, [TokenLogprobs(a, math.nan, ((a, math.nan),))]).content
    assert content[0].logprob == content[0].top_logprobs[0].logprob == LOGPROB_FLOOR
