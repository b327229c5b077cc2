"""The think block of a reply split from its answer, whole and streamed in every cut of the same text."""

from __future__ import annotations

import json

import pytest

from omnistage.server.reasoning import Split, StreamSplitter, chosen_parser, opens_thinking, split

CASES = [
    # (reply, the reply starts inside the block, reasoning, content)
    ("<think>\nadd them</think>\n\nfour", False, "\nadd them", "\n\nfour"),
    ("\nadd them\n</think>\n\nfour", True, "\nadd them\n", "\n\nfour"),
    ("four, no thinking", False, "", "four, no thinking"),
    ("cut short inside", True, "cut short inside", ""),
    ("<think>cut short", False, "cut short", ""),
    ("a < b </thi", True, "a < b </thi", ""),  # a partial tag at the end is text after all
    ("x</think>y</think>z", True, "x", "y</think>z"),  # only the first closing tag ends the block
    ("<thin", False, "", "<thin"),
    ("", True, "", ""),
]


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), CASES)
def test_split_of_a_whole_reply(reply, inside, reasoning, content):
    assert split(reply, inside) == Split(reasoning, content)


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), CASES)
def test_every_streaming_cut_gives_the_whole_split(reply, inside, reasoning, content):
    for cut in range(len(reply) + 1):
        for pieces in ([reply[:cut], reply[cut:]], list(reply)):
            splitter = StreamSplitter(inside)
            parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
            assert "".join(p.reasoning for p in parts) == reasoning, (pieces, parts)
            assert "".join(p.content for p in parts) == content, (pieces, parts)


def test_reasoning_streams_before_the_block_closes():
    splitter = StreamSplitter(inside=True)
    assert splitter.feed("first ") == Split(reasoning="first ")
    assert splitter.feed("then</") == Split(reasoning="then")  # "</" may begin the closing tag
    assert splitter.feed("think>ans") == Split(content="ans")
    assert splitter.feed("wer") == Split(content="wer")


def test_the_prompt_tells_where_the_reply_starts():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_auto_runs_the_parser_for_checkpoints_without_a_talker(tmp_path):
    assert chosen_parser("auto", tmp_path) is None  # no config.json
    config = {"model_type": "qwen3_omni_moe", "enable_audio_output": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert chosen_parser("auto", tmp_path) == "qwen3"
    assert chosen_parser("none", tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(config | {"enable_audio_output": True}))
    assert chosen_parser("auto", tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))  # no talker_config
    assert chosen_parser("auto", tmp_path) == "qwen3"
    assert chosen_parser("qwen3", tmp_path) == "qwen3"
