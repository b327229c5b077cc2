"""Constrained decoding through xgrammar: a request's StructuredOutput (omnistage/request.py) compiled once per
distinct constraint against the model's vocabulary (`Grammars`, a bounded cache), and per sequence a matcher
(`GrammarState`) that fills the row's token bitmask before each sample and advances on the sampled token.

xgrammar rather than llguidance: on our vocabulary it compiles a typical schema and fills a step's masks faster
(benchmarks/RESULTS.md, "Grammar libraries on the CPU"). JSON is compact (no free whitespace): random or weak
weights would otherwise pad an object with whitespace to the length limit, and a finished object ends the
sequence at once.

`check` builds a constraint's grammar without the vocabulary, which is quick: the server's edge calls it so that
a schema the library refuses is a 400 naming its field before anything is queued.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from omnistage.errors import InvalidRequest
from omnistage.request import StructuredOutput, ToolSchema

_BATCH = xgr.BatchGrammarMatcher()

# Distinct constraints kept compiled; a compiled JSON schema over Qwen's vocabulary is tens of KB to a few MB.
CACHE_SIZE = 128


class InvalidConstraint(InvalidRequest):
    """A constraint the grammar library cannot compile; `param` names the request's field it came from
    (`response_format`, `tools`), which the server's 400 names too."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param, self.reason = param, reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses the engine process's pipe whole
        return (type(self), (self.param, self.reason))


def field_of(structured: StructuredOutput) -> str:
    """The request field a constraint comes from, as the client named it."""
    if structured.tools:
        return "tools"
    return "grammar" if structured.grammar is not None else "response_format"


def check(structured: StructuredOutput) -> None:
    """Raise InvalidConstraint if the grammar library refuses the constraint (no vocabulary needed)."""
    try:
        _grammar(structured)
    except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise InvalidConstraint(field_of(structured), f"the constraint cannot be compiled ({exc})") from None


class Grammars:
    """The constraints compiled against one model's vocabulary: `vocab_size` columns of its logits (padded past
    the tokenizer: those columns never pass), its special tokens never inside the output, `stop_token_ids` (its
    end tokens) allowed once a grammar is complete. Thread-safe, so that a compile may run off the engine's
    thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer, vocab_size),
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=vocab_size,
            stop_token_ids=stop_token_ids,
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, structured: StructuredOutput) -> bool:
        """Whether the constraint is compiled already (in the cache)."""
        with self._lock:
            return structured in self._cache

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The constraint compiled, from the cache when it was lately; raises InvalidConstraint."""
        with self._lock:
            if (hit := self._cache.get(structured)) is not None:
                self._cache.move_to_end(structured)
                return hit
        try:
            compiled = self._compiler.compile_grammar(_grammar(structured))
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
            raise InvalidConstraint(
                field_of(structured), f"the constraint cannot be compiled ({exc})"
            ) from None
        with self._lock:
            self._cache[structured] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, structured: StructuredOutput) -> GrammarState:
        """A new sequence's matcher of the constraint."""
        ends_when_complete = not (structured.tools and structured.parallel_tool_calls)
        return GrammarState(xgr.GrammarMatcher(self.compile(structured)), ends_when_complete)


class GrammarState:
    """One sequence's place in its grammar. `ends_when_complete`: the sequence ends as soon as its output is a
    whole sentence of the grammar (a JSON value); else (several tool calls) once the model picks an end token,
    which the grammar allows only then."""

    def __init__(self, matcher: xgr.GrammarMatcher, ends_when_complete: bool) -> None:
        self.matcher, self.ends_when_complete = matcher, ends_when_complete

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the int32 `bitmask` (`allocate_bitmask`): the tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance past the sampled `token`, which the mask allowed."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    @property
    def done(self) -> bool:
        """The output is complete: nothing may follow it."""
        return self.matcher.is_terminated() or (self.ends_when_complete and self.matcher.is_completed())


def fill_bitmask(states: list[GrammarState], rows: list[int], num_rows: int, vocab_size: int) -> torch.Tensor:
    """A host int32 bitmask of `num_rows` rows over `vocab_size` tokens whose row `rows[i]` holds what
    `states[i]` allows next (the other rows allow every token). Several rows fill on threads (a quarter of the
    time of one after another at batch 32: benchmarks/RESULTS.md, "Grammar libraries on the CPU")."""
    bitmask = allocate_bitmask(num_rows, vocab_size)
    if len(states) == 1:
        states[0].fill(bitmask, rows[0])
    else:
        _BATCH.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
    return bitmask


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host int32 bitmask of `rows` rows over `vocab_size` tokens (one bit a token), for `GrammarState.fill`."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits whose tokens `bitmask` (`fill_bitmask`'s, on the logits' device)
    forbids. A row of no grammar allows every token: its logits are left as they are. No list of rows: xgrammar
    would copy one up from pageable memory, which may make the host wait for the device."""
    xgr.apply_token_bitmask_inplace(logits, bitmask)


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each id's byte-level text, "" (never allowed) for special tokens and the padded ids past the tokenizer;
    the tool-call tags, which the tokenizer keeps as plain added tokens, keep their text."""
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return vocab


def _grammar(structured: StructuredOutput) -> xgr.Grammar:
    if structured.tools:
        return _json_strings(_tool_calls(structured.tools, structured.parallel_tool_calls))
    if structured.grammar is not None:
        return xgr.Grammar.from_ebnf(structured.grammar)
    if structured.json_schema is not None:
        schema = structured.json_schema
        return _json_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return _json_strings(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))


# The rule xgrammar writes for one character of a string with `minLength` or `maxLength`: any but a quote, a
# backslash, CR and LF. It lets through the other control characters (a tab, U+001C, ...), which JSON allows in
# a string only escaped, so a sampled value could break the JSON around it (Python's json refuses it). Where a
# later xgrammar writes that rule otherwise, nothing is rewritten and tests/unit/engine/test_structured.py
# says whether the hole is still there.
_BOUNDED_STRING_CHARACTER = re.compile(r'^(\S+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"  # the class of its unbounded strings' unescaped characters

# The escape xgrammar lets an unbounded string or a key write for a code unit, any four hex digits: a lone
# UTF-16 surrogate too (`\ud800`), which JSON's grammar allows but no UTF-8 can hold (pydantic's parser refuses
# it, and a str decoded from it cannot be encoded). Rewritten: a high surrogate only before a low one, a low
# one never alone; as above, the test says whether a later xgrammar's spelling still lets it through. A
# `pattern` is matched against a string's JSON text, escapes and all, so a schema may still ask for one.
_CODE_UNIT_ESCAPE = '("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'
_SCALAR_ESCAPE = (
    '("u" [0-9A-Ca-cE-Fe-f] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'
    ' | ("u" [Dd] [0-7] [A-Fa-f0-9] [A-Fa-f0-9])'
    ' | ("u" [Dd] [89ABab] [A-Fa-f0-9] [A-Fa-f0-9] "\\\\u" [Dd] [C-Fc-f] [A-Fa-f0-9] [A-Fa-f0-9])'
)


def _json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar`, a JSON schema's, whose strings are valid JSON and valid Unicode: its length-bounded strings
    hold no unescaped control character (as its unbounded ones already do not), and no escape writes a lone
    surrogate."""
    text = str(grammar)
    fixed = _BOUNDED_STRING_CHARACTER.sub(lambda rule: rule[1] + _JSON_STRING_CHARACTER + rule[2], text)
    fixed = fixed.replace(_CODE_UNIT_ESCAPE, _SCALAR_ESCAPE)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _tool_calls(tools: tuple[ToolSchema, ...], parallel: bool) -> xgr.Grammar:
    """Qwen3's tool calls: `<tool_call>\\n{"name": <a tool's name>, "arguments": <its parameters>}\\n</tool_call>`,
    once, or (parallel) once or more, a newline between two."""
    tags = [
        xgr.structural_tag.TagFormat(
            begin=f'<tool_call>\n{{"name": {json.dumps(tool.name)}, "arguments": ',
            content=xgr.structural_tag.JSONSchemaFormat(
                json_schema=json.loads(tool.parameters), max_whitespace_cnt=1
            ),
            end="}\n</tool_call>",
        )
        for tool in tools
    ]
    calls = xgr.structural_tag.TagsWithSeparatorFormat(
        tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel
    )
    return xgr.Grammar.from_structural_tag(xgr.StructuralTag(format=calls))
