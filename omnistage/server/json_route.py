"""The route of every JSON endpoint: its body parsed once, and refused where it holds text that is not valid
Unicode."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from omnistage.server.errors import InvalidField

# A lone UTF-16 surrogate, which no UTF-8 text (the tokenizer's, a response's) can hold, reaches json.loads spelled
# as a \u escape or as the three bytes UTF-8 would give it (json.loads decodes with "surrogatepass"). The raw
# body is scanned for either first (two patterns: one alternation of both scans 31 MB in 90 ms, these in 25),
# each only where its first byte occurs at all: a byte is found at memchr's speed (a clip's 300 KB of base64 has
# neither, and its regex scan took 0.15 ms on the CPU machine).
_MAYBE_SURROGATE = ((b"\\", re.compile(rb"\\u[dD][89a-fA-F]")), (b"\xed", re.compile(rb"\xed[\xa0-\xbf]")))
_SURROGATE = re.compile("[\ud800-\udfff]")


def may_hold_surrogates(body: bytes) -> bool:
    return any(first in body and pattern.search(body) for first, pattern in _MAYBE_SURROGATE)


def invalid_text(data: Any) -> tuple[str, str] | None:
    """(path, reason) of the first string of parsed JSON that is not valid Unicode (a lone surrogate), or None.

    Paths are spelled as validation errors spell them: `messages[0].content[1].text`.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return path, "not valid Unicode (it holds a lone UTF-16 surrogate)"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if _SURROGATE.search(key):
                    return path, "a key is not valid Unicode (it holds a lone UTF-16 surrogate)"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


class JSONRoute(APIRoute):
    """A JSON route whose body may hold only valid Unicode: a JSON escape of a lone surrogate ("\\ud800"),
    which json.loads accepts but no tokenizer or response can encode, is a 400 naming its field, before
    anything else sees the body. This is the one place text from a JSON body is checked for it.

    A body without any is parsed by pydantic-core's JSON parser, ten times json.loads' speed on a clip's
    body (16 against 165 µs for 300 KB on the CPU machine, on the event loop), and kept where Starlette keeps
    a parsed body, so that FastAPI does not parse it again; it gives the same values as json.loads for any
    JSON it accepts, and whatever it refuses (invalid JSON, a byte-order mark, nesting beyond its limit) is
    left to FastAPI's json.loads and its errors, as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if may_hold_surrogates(body):
                try:
                    data = await request.json()  # kept on the request: the handler does not parse it again
                except ValueError:
                    data = None  # not JSON: the handler reports that
                if (found := invalid_text(data)) is not None:
                    raise InvalidField(*found)
            else:
                try:
                    request._json = pydantic_core.from_json(body)  # Request.json()'s own cache
                except ValueError:
                    pass
            return await handler(request)

        return checked
