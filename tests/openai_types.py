"""Answers checked against the openai SDK's types strictly: the SDK's models take unknown keys silently and
are built without validation, so here each answer is validated as the type and must hold no field it lacks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, TypeAdapter


def strictly(kind: Any, data: dict[str, Any]) -> Any:
    """`data` validated as the SDK's type `kind`, holding no field that type lacks."""
    value = _adapter(kind).validate_python(data)
    unknown = list(_extra_fields(value, "")) if isinstance(value, BaseModel) else []
    assert not unknown, f"fields the SDK's {kind} lacks: {unknown}"
    return value


@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def _extra_fields(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        yield from (f"{path}.{name}" for name in value.model_extra or {})
        for name in type(value).model_fields:
            yield from _extra_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _extra_fields(item, f"{path}[{i}]")
