"""The Jinja environment a checkpoint's chat template renders in, the one transformers' `apply_chat_template`
gives it: blocks trimmed, `break`/`continue`, `raise_exception`, `strftime_now`, and a `tojson` that writes
JSON as json.dumps does (Jinja's own escapes HTML, which would change what the model reads)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The compiled template and the variables it reads from its caller (`tools` among them where it renders
    a request's tools)."""
    env = environment()
    return env.from_string(source), frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
