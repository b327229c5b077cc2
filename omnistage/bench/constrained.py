"""What benchmarks/constrained.py measures with, kept apart from the runs: the schema whose valid outputs are
too long to finish within the decode length (so a constrained request and a free one decode the same number of
tokens), a Thinking checkpoint whose chat template opens the think block, and a streamed chat's deltas read
into reasoning and content with their times."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.bench.stats import RequestTiming
from omnistage.request import StructuredOutput

# A list of records. No Qwen token joins two ASCII words or digits across a space or JSON's punctuation, nor a
# digit to a letter or another digit (tests/unit/bench/test_constrained_bench.py checks the vocabulary), and a
# record spells five such pieces (`id`, a digit, `name`, `active`, `true` or `false`), each in a token of its
# own: no output of the schema is complete within 5 * MIN_RECORDS - 1 tokens, so a constrained request runs to
# `max_tokens` as a free one does (the run checks each request's count anyway).
MIN_RECORDS = 64
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": MIN_RECORDS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 24},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "name", "active"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}


def records_constraint() -> StructuredOutput:
    """`response_format: {"type": "json_schema", ...}` of RECORDS_SCHEMA as the engine takes it."""
    return StructuredOutput(json_schema=json.dumps(RECORDS_SCHEMA))


def longest_forced_length() -> int:
    """The most tokens a decode may force while no output of RECORDS_SCHEMA can be complete yet."""
    return 5 * MIN_RECORDS - 1


# The generation prompt of Qwen3's Thinking templates: the assistant's turn opens the think block, so that the
# reply starts inside it; `enable_thinking` false closes an empty block instead and the reply is the answer.
THINKING_GENERATION_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def opened_template(template: str) -> str:
    """`template` (a Qwen chat template) with the Thinking generation prompt in place of its own."""
    head = template[: template.index("{%- if add_generation_prompt")]
    return head + THINKING_GENERATION_PROMPT


def thinking_checkpoint(directory: Path, source: Path | None = None) -> Path:
    """A Thinking checkpoint in `directory` whose chat template opens the think block: `source`'s files linked
    (a tiny one, with weights), or without one a skeleton at the released sizes (for `--load-format dummy`):
    the Instruct config with `enable_audio_output` false and no `talker_config` or `code2wav_config`, the
    Thinker alone as the Thinking checkpoint is."""
    from omnistage.models.qwen3_omni.tiny import PREPROCESSOR_CONFIG, released_config
    from omnistage.models.qwen3_omni.tokenizer import CHAT_TEMPLATE, write_tokenizer_files

    directory.mkdir(parents=True, exist_ok=True)
    if source is None:
        config = released_config()
        config["enable_audio_output"] = False
        del config["talker_config"], config["code2wav_config"]
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
        write_tokenizer_files(directory, opened_template(CHAT_TEMPLATE))
        return directory
    for path in source.iterdir():
        if path.name != "chat_template.jinja":
            os.symlink(path.resolve(), directory / path.name)
    template = (source / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").write_text(opened_template(template))
    return directory


@dataclass
class StreamedReply:
    """One streamed chat: when its request was written, when each delta with text came and what kind it was
    (`reasoning` or `content`), and the tokens its usage counted."""

    started: float
    deltas: list[tuple[float, str]] = field(default_factory=list)
    completion_tokens: int = 0

    def add(self, event: dict[str, Any], now: float | None = None) -> None:
        """Take one chat.completion.chunk payload."""
        at = time.perf_counter() if now is None else now
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
                if delta.get(key):
                    self.deltas.append((at, kind))
        if event.get("usage"):
            self.completion_tokens = event["usage"]["completion_tokens"]

    def count(self, kind: str) -> int:
        return sum(1 for _, k in self.deltas if k == kind)

    @property
    def order(self) -> str:
        """The kinds in the order they came, runs merged: `reasoning`, `reasoning>content`, `content`..."""
        runs: list[str] = []
        for _, kind in self.deltas:
            if not runs or runs[-1] != kind:
                runs.append(kind)
        return ">".join(runs) or "-"

    def timing(self) -> RequestTiming:
        """TTFT to the first delta with text, TPOT over the usage's tokens to the last one."""
        if not self.deltas:
            raise RuntimeError("the stream carried no text")
        first, last = self.deltas[0][0], self.deltas[-1][0]
        return RequestTiming(0.0, first - self.started, last - self.started, self.completion_tokens)


def ratio_row(
    batch: int, tokens: int, free: dict[str, Any], constrained: dict[str, Any], not_ahead: dict[str, Any]
) -> str:
    """A markdown row: batch, tokens each request decoded, the TPOT medians free, constrained and their ratio,
    free without decoding ahead (for scale: constrained steps decode ahead too), and the TTFT medians free and
    constrained."""
    ratio = constrained["tpot_median_ms"] / free["tpot_median_ms"]
    return (
        f"| {batch} | {tokens} | {free['tpot_median_ms']:.2f} | {constrained['tpot_median_ms']:.2f} | "
        f"{ratio:.3f} | {not_ahead['tpot_median_ms']:.2f} | {free['ttft_median_ms']:.1f} | "
        f"{constrained['ttft_median_ms']:.1f} |"
    )


RATIO_HEADER = (
    "| batch | tokens each | TPOT ms, free | TPOT ms, json_schema | ratio | TPOT ms, free, not ahead "
    "| TTFT ms, free | TTFT ms, json_schema |\n"
    "|---|---|---|---|---|---|---|---|"
)
