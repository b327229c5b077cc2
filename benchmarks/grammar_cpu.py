"""xgrammar against llguidance on the CPU, for constrained decoding over Qwen's vocabulary (the tiny
checkpoint's tokenizer.json: 151,643 BPE ranks and the added tokens, logits padded to 152,064): the time to
compile a typical JSON schema, and a decode step's mask fill at batch 1 and 32 (each row its own matcher,
walked along one valid output so that every step fills from a real parser state).

    python benchmarks/grammar_cpu.py /path/to/tiny-checkpoint
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

VOCAB = 152064  # the Thinker's logits: the tokenizer's ids padded
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "status"],
    "additionalProperties": False,
}
OUTPUT = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], '
    '"address": {"street": "St James Square 12", "city": "London"}, "status": "active", "score": 9.5}'
)
REPEATS = 5


def ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.3f} ms"


def xgrammar_case(tokenizer: Tokenizer, ids: list[int]) -> dict[str, str]:
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=VOCAB, stop_token_ids=[151645]
    )
    setup = time.perf_counter() - started
    compiles = []
    for i in range(REPEATS):  # a fresh compiler each time: no cache hit
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        schema = json.dumps({**SCHEMA, "title": f"t{i}"})
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        compiles.append(time.perf_counter() - started)
    result = {"tokenizer setup": f"{setup * 1e3:.0f} ms", "compile": ms(compiles)}
    for batch in (1, 32):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
        logits = torch.randn(batch, VOCAB)
        fills, applies = [], []
        for token in ids:
            started = time.perf_counter()
            for row, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, row)
            fills.append(time.perf_counter() - started)
            started = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            applies.append(time.perf_counter() - started)
            for m in matchers:
                assert m.accept_token(token)
        result[f"fill, batch {batch}"] = ms(fills)
        result[f"apply, batch {batch}"] = ms(applies)
        if batch > 1:
            batched = xgr.BatchGrammarMatcher()
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            fills = []
            for token in ids:
                started = time.perf_counter()
                batched.batch_fill_next_token_bitmask(matchers, bitmask)
                fills.append(time.perf_counter() - started)
                for m in matchers:
                    m.accept_token(token)
            result[f"fill, batch {batch}, threaded"] = ms(fills)
    return result


def llguidance_case(tokenizer: Tokenizer, ids: list[int]) -> dict[str, str]:
    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer), n_vocab=VOCAB)
    setup = time.perf_counter() - started
    compiles = []
    for i in range(REPEATS):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({**SCHEMA, "title": f"t{i}"}),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.compute_bitmask()  # llguidance builds lazily: the first mask is part of the compile
        compiles.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
    result = {"tokenizer setup": f"{setup * 1e3:.0f} ms", "compile": ms(compiles)}
    for batch in (1, 32):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        bitmask = llguidance.torch.allocate_token_bitmask(batch, VOCAB)
        fills = []
        for token in ids:
            started = time.perf_counter()
            for row, m in enumerate(matchers):
                llguidance.torch.fill_next_token_bitmask(m, bitmask, row)
            fills.append(time.perf_counter() - started)
            for m in matchers:
                assert m.consume_token(token), m.get_error()
        result[f"fill, batch {batch}"] = ms(fills)
        if batch > 1:
            matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
            fills = []
            for token in ids:
                started = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask_par(
                    llguidance.LLExecutor(), [(m, i) for i, m in enumerate(matchers)], bitmask
                )
                fills.append(time.perf_counter() - started)
                for m in matchers:
                    m.consume_token(token)
            result[f"fill, batch {batch}, threaded"] = ms(fills)
    return result


def main() -> None:
    tokenizer = Tokenizer.from_file(str(Path(sys.argv[1]) / "tokenizer.json"))
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False).ids
    print(f"torch {torch.__version__}, xgrammar {version('xgrammar')}, llguidance {version('llguidance')}")
    print(f"{len(ids)} decode steps per run; medians")
    for name, case in (("xgrammar", xgrammar_case), ("llguidance", llguidance_case)):
        for key, value in case(tokenizer, ids).items():
            print(f"{name:10} {key:30} {value}")


if __name__ == "__main__":
    main()
