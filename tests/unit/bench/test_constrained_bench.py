"""benchmarks/constrained.py's pieces: the schema that outlasts the forced decode length (checked against Qwen's
real vocabulary), the Thinking checkpoints it serves (their template opening the think block, the server's
reasoning parser on), and a streamed chat's deltas read into reasoning, content and their times."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer

from omnistage.bench.constrained import (
    MIN_RECORDS,
    RATIO_HEADER,
    StreamedReply,
    longest_forced_length,
    ratio_row,
    records_constraint,
    thinking_checkpoint,
)
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.server.reasoning import AUTO, chosen_parser

# Two ASCII words or digits across a space or JSON's punctuation, or a digit beside a letter or another digit.
CROSSING = re.compile(
    r'[A-Za-z0-9][^A-Za-z0-9]*[\s":,{}\[\]][^A-Za-z0-9]*[A-Za-z0-9]|[0-9][A-Za-z0-9]|[A-Za-z][0-9]'
)


def test_no_token_spans_two_pieces_of_a_record(tiny_checkpoint):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    texts = tokenizer.decode_batch(
        [[i] for i in range(tokenizer.get_vocab_size())], skip_special_tokens=False
    )
    assert len(texts) > 151_000
    assert [t for t in texts if CROSSING.search(t)] == []
    # and the pieces a record spells are five: its key words, its boolean and (at least) a digit
    record = json.dumps({"id": 7, "name": "", "active": True}, separators=(",", ":"))
    assert re.findall(r"[A-Za-z]+|[0-9]", record) == ["id", "7", "name", "active", "true"]
    assert longest_forced_length() == 5 * MIN_RECORDS - 1 >= 128


def test_the_constraint_is_the_records_schema():
    schema = json.loads(records_constraint().json_schema)
    assert schema["properties"]["records"]["minItems"] == MIN_RECORDS
    assert records_constraint() == records_constraint()  # one compile serves every request


def rendered(directory, **kwargs) -> str:
    return Processor(directory).encode_chat([{"role": "user", "content": "Hi"}], True, None, kwargs)[0]


def test_the_released_thinking_skeleton(tmp_path):
    directory = thinking_checkpoint(tmp_path / "released")
    config = json.loads((directory / "config.json").read_text())
    assert "talker_config" not in config
    assert config["thinker_config"]["text_config"]["num_hidden_layers"] == 48  # the released sizes
    assert not Qwen3OmniConfig.from_dict(config).enable_audio_output
    assert chosen_parser(AUTO, directory) == "qwen3"
    assert rendered(directory).endswith("<|im_start|>assistant\n<think>\n")
    assert rendered(directory, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_a_tiny_thinking_checkpoint_keeps_its_files(tiny_thinking_checkpoint, tmp_path):
    directory = thinking_checkpoint(tmp_path / "tiny", tiny_thinking_checkpoint)
    assert (directory / "model.safetensors").resolve() == (
        tiny_thinking_checkpoint / "model.safetensors"
    ).resolve()
    assert chosen_parser(AUTO, directory) == "qwen3"
    assert not rendered(tiny_thinking_checkpoint).endswith("<think>\n")
    assert rendered(directory).endswith("<|im_start|>assistant\n<think>\n")


def chunk(**delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def test_a_stream_read_into_reasoning_and_content():
    reply = StreamedReply(started=10.0)
    reply.add(chunk(role="assistant", content=""), now=10.01)  # the role's chunk carries no text
    reply.add(chunk(reasoning_content="Two"), now=10.05)
    reply.add(chunk(reasoning_content=" and two."), now=10.06)
    reply.add(chunk(content="Four."), now=10.08)
    reply.add(
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}, now=10.09
    )
    assert (reply.count("reasoning"), reply.count("content"), reply.order) == (2, 1, "reasoning>content")
    timing = reply.timing()
    assert timing.ttft_s == pytest.approx(0.05) and timing.output_tokens == 4
    assert timing.tpot_s == pytest.approx(0.01)
    with pytest.raises(RuntimeError, match="no text"):
        StreamedReply(started=0.0).timing()


def test_ratio_row():
    free = {"tpot_median_ms": 10.0, "ttft_median_ms": 30.0}
    constrained = {"tpot_median_ms": 10.5, "ttft_median_ms": 31.0}
    not_ahead = {"tpot_median_ms": 10.25, "ttft_median_ms": 30.5}
    row = ratio_row(32, 128, free, constrained, not_ahead)
    assert row == "| 32 | 128 | 10.00 | 10.50 | 1.050 | 10.25 | 30.0 | 31.0 |"
    assert row.count("|") == RATIO_HEADER.splitlines()[0].count("|")
