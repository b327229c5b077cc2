"""A corpus of malformed and hostile requests against a live `omnistage serve` (tiny checkpoint, CPU).

Every route, every field type, media, unicode, sizes, methods, content types and auth. Each malformed case
must get an OpenAI-shaped JSON error (`{"error": {"message", "type", "param", "code"}}`) with its 4xx
status, never a 5xx nor a dropped connection; the hostile-but-valid cases (unicode text, OpenAI fields the
server ignores) must succeed. After each batch the server must still be healthy: /health answers, a normal
request completes, and every KV page is free again. Requests are raw httpx, so bytes no client library
would send (lone surrogates, broken UTF-8, multipart garbage) reach the server as written.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tests.server.conftest import SHARED_MODEL

MODEL = SHARED_MODEL  # the open server is the shared one
API_KEY = "sk-corpus"
MAX_BODY_BYTES = 1_000_000
MAX_MODEL_LEN = 2048
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
BIG = 2**63  # one past int64

_UNSET = object()


@dataclass(frozen=True)
class Case:
    """One request and the statuses it may get (an error body is checked for every status >= 400)."""

    name: str
    path: str = CHAT
    method: str = "POST"
    json: Any = _UNSET
    content: Any = None  # bytes, or an iterator of bytes (sent chunked)
    data: dict[str, str] | None = None
    files: dict[str, Any] | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)  # bytes go out as they are
    auth: bool = True  # send the server's API key
    status: tuple[int, ...] = (400,)
    code: str | None = None  # the error's `code`, where one is due

    def send(self, client: httpx.Client) -> httpx.Response:
        headers = dict(self.headers)
        if self.auth:
            headers.setdefault("Authorization", f"Bearer {API_KEY}")
        body: dict[str, Any] = {"json": self.json} if self.json is not _UNSET else {"content": self.content}
        return client.request(
            self.method, self.path, data=self.data, files=self.files, headers=headers, **body
        )


# Every case is cheap (two output tokens at most): one that takes longer held the server up.
MAX_SECONDS = 5.0


def check(client: httpx.Client, case: Case) -> None:
    try:
        response = case.send(client)
    except httpx.TransportError as exc:  # a reset connection: the server broke on the request
        pytest.fail(f"no response ({type(exc).__name__}: {exc})")
    assert response.status_code < 500, f"{response.status_code} {response.text[:300]}"
    seconds = response.elapsed.total_seconds()
    assert seconds < MAX_SECONDS, f"answered {response.status_code} after {seconds:.1f} s"
    assert response.status_code in case.status, (
        f"expected {case.status}, got {response.status_code}: {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert_openai_error(response, case.code)
    else:
        assert_answered(case, response)


def assert_openai_error(response: httpx.Response, code: str | None = None) -> None:
    assert response.headers.get("content-type", "").startswith("application/json"), response.text[:200]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if code is not None:
        assert error["code"] == code, error


def assert_answered(case: Case, response: httpx.Response) -> None:
    if "text/event-stream" in response.headers["content-type"]:
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]", response.text[-300:]
        assert not any('"error"' in e for e in events), response.text[-300:]
    elif case.path == CHAT:
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
    elif case.path == COMPLETIONS:
        assert isinstance(response.json()["choices"][0]["text"], str)


# -- bodies and media ------------------------------------------------------------------------------------


def chat(**fields: Any) -> dict[str, Any]:
    """A valid, cheap chat body with `fields` added or replaced."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def raw_chat(content: str, **fields: str) -> bytes:
    """A chat body spelled by hand: `content` and `fields` are JSON text, put in as written."""
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    message = f'{{"role": "user", "content": {content}}}'
    return f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{message}]{extra}}}'.encode()


def raw_completion(prompt: str, **fields: str) -> bytes:
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    return f'{{"model": "{MODEL}", "max_tokens": 2, "prompt": {prompt}{extra}}}'.encode()


def with_parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}])


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def wav_bytes(seconds: float, rate: int = 16000, subtype: str = "PCM_16", fill: float = 0.0) -> bytes:
    buffer = io.BytesIO()
    samples = np.full(round(seconds * rate), fill, dtype=np.float32)
    sf.write(buffer, samples, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def wav_header(rate: int, channels: int = 1, bits: int = 16, data_bytes: int = 0) -> bytes:
    """A RIFF/WAVE header declaring what the caller says, whatever follows it."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, bits)
    riff = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
    return riff + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_bytes)


def png_bytes(width: int = 56, height: int = 84) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` x `height` pixels, followed by a scrap of image data."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def multipart(boundary: str, body: bytes) -> dict[str, Any]:
    return {"content": body, "headers": {"Content-Type": f"multipart/form-data; boundary={boundary}"}}


def form_part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--xyz\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


SPEECH_WAV = SPEECH.read_bytes()
PNG = png_bytes()
LONG_AUDIO = wav_bytes(301, rate=1000, subtype="PCM_U8")  # 301 s in 301 KB: over the 300 s the model takes
MEDIA_DIR_FILES = {"speech.wav": SPEECH_WAV, "picture.png": PNG, "notes.txt": b"not media"}


def transcription(
    name: str, file: bytes | None = SPEECH_WAV, status: tuple[int, ...] = (400,), **form: str | None
) -> Case:
    """A transcription form: the model, two output tokens, the speech clip, and `form` on top."""
    fields = {k: v for k, v in {"model": MODEL, "max_tokens": "2", **form}.items() if v is not None}
    files = {"file": ("clip.wav", file, "audio/wav")} if file is not None else None
    return Case(name, TRANSCRIPTIONS, data=fields, files=files, status=status)


# -- the corpus, in batches ---------------------------------------------------------------------------------
# fmt: off

ROUTES = [
    *[Case(f"unknown {m} {p:.60}", p, method=m, status=(404,)) for m, p in [
        ("GET", "/v1"), ("POST", "/v1/chat"), ("POST", "/v1/chat/completion"),
        ("POST", "/v2/chat/completions"), ("POST", "/v1/embeddings"), ("POST", "/v1/images/generations"),
        ("GET", "/healthz"), ("GET", "/metrics/x"), ("GET", "/v1/%2e%2e/health"),
        ("POST", "/v1/chat/completions%00"), ("GET", "/x" + "a" * 8000), ("GET", "/v1/models/"),
        ("GET", "/v1/models/nope"), ("GET", "/v1/models/tiny/extra"), ("GET", "/v1/models/%F0%9F%98%80"),
        ("GET", "/v1/models/%ff%fe"), ("GET", "/v1/models/%ED%A0%80"), ("GET", "/v1/models/tiny%00"),
        ("GET", "/playground/nope.js"), ("GET", "/playground/index.html"),
        ("GET", "/playground/app.js/x"), ("GET", "/playground/%2e%2e/metrics"),
        ("GET", "/playground/app.js%00"), ("GET", "/index.html"),
    ]],
    *[Case(f"{m} {p}", p, method=m, status=(405,)) for m, p in [
        ("GET", CHAT), ("PUT", CHAT), ("DELETE", CHAT), ("PATCH", CHAT), ("OPTIONS", CHAT),
        ("GET", COMPLETIONS), ("PUT", COMPLETIONS), ("GET", TRANSCRIPTIONS), ("DELETE", TRANSCRIPTIONS),
        ("GET", "/v1/audio/speech"), ("PUT", "/v1/audio/speech"), ("GET", "/v1/audio/translations"),
        ("POST", "/v1/models"), ("DELETE", "/v1/models"), ("PUT", f"/v1/models/{MODEL}"),
        ("DELETE", f"/v1/models/{MODEL}"), ("POST", "/health"), ("DELETE", "/health"), ("POST", "/metrics"),
        ("POST", "/"), ("PUT", "/playground"), ("POST", "/playground/app.js"),
    ]],
]

JSON_BODIES = [
    *[Case(f"chat body {body[:40]!r}", content=body, headers={"Content-Type": "application/json"})
      for body in [
        b"", b"null", b"[]", b"123", b'"a string"', b"true", b"{", b"}", b'{"model": "tiny",}',
        b"{'model': 'tiny'}", b'{"model": "tiny" /* comment */}', b'{"model": tiny}', b"{}",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]} trailing',
        b'{"messages": [{"role": "user", "content": "Hi"}]}', b'{"model": "tiny"}',
        b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ]],
    *[Case(f"completions body {body[:40]!r}", COMPLETIONS, content=body,
           headers={"Content-Type": "application/json"})
      for body in [b"", b"null", b"[]", b"{", b"{}", b'{"model": "tiny"}', b'{"prompt": "Hi"}']],
]

CHAT_FIELDS = [
    *[Case(f"model={v!r}", json=chat(model=v)) for v in [None, 123, 1.5, True, [], {}, ["tiny"]]],
    *[Case(f"model={v!r}", json=chat(model=v), status=(404,), code="model_not_found")
      for v in ["", "nope", "TINY", " tiny", "tiny ", "tiny\n", "../tiny"]],
    *[Case(f"messages={v!r:.70}", json=chat(messages=v)) for v in [
        None, [], "Hi", {}, 5, [None], [1], ["Hi"], [[]], [{}],
        [{"role": "user"}], [{"content": "Hi"}], [{"role": "robot", "content": "Hi"}],
        [{"role": 5, "content": "Hi"}], [{"role": None, "content": "Hi"}],
        [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": {}}], [{"role": "user", "content": [5]}],
        [{"role": "user", "content": [None]}], [{"role": "user", "content": [{}]}],
        [{"role": "user", "content": [{"text": "Hi"}]}], [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": 5, "text": "Hi"}]}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": None}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": "AAAA"}]}],
        [{"role": "user", "content": "Hi", "name": 5}],
        [{"role": "user", "content": "Hi", "definitely_not_a_field": 1}],
    ]],
    Case("an unknown top-level field", json=chat(definitely_not_a_field=1)),
    Case("ten thousand unknown fields", json=chat(**{f"x{i}": i for i in range(10_000)})),
]

SAMPLING = [
    *[Case(f"{k}={v!r:.30}", json=chat(**{k: v})) for k, v in [
        ("temperature", "hot"), ("temperature", True), ("temperature", -1), ("temperature", []),
        ("temperature", 10**400), ("temperature", -(10**400)),
        ("top_p", 0), ("top_p", -0.5), ("top_p", 1.5), ("top_p", "x"), ("top_p", False),
        ("top_k", BIG), ("top_k", 2**64), ("top_k", 10**400), ("top_k", -BIG - 1), ("top_k", -5),
        ("top_k", 1.5), ("top_k", "5"), ("top_k", True),
        ("min_p", -0.1), ("min_p", 2), ("min_p", "x"),
        ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", BIG), ("max_tokens", 10**400),
        ("max_tokens", True), ("max_tokens", "16"), ("max_tokens", []), ("max_tokens", 1.5),
        ("max_tokens", MAX_MODEL_LEN), ("max_tokens", 2**31),
        ("max_completion_tokens", -1), ("max_completion_tokens", "x"), ("max_completion_tokens", BIG),
        ("n", 17), ("n", 0), ("n", -1), ("n", BIG), ("n", "1"),
        ("seed", BIG), ("seed", 2**64), ("seed", -BIG - 1), ("seed", "abc"), ("seed", 1.5),
        ("stop", 123), ("stop", [1, 2]), ("stop", [None]), ("stop", {"a": 1}), ("stop", [""]),
        ("stop_token_ids", ["a"]), ("stop_token_ids", [BIG]), ("stop_token_ids", [-1]), ("stop_token_ids", 5),
        ("presence_penalty", 3), ("presence_penalty", -3), ("presence_penalty", "x"),
        ("frequency_penalty", 5), ("frequency_penalty", -5),
        ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", "x"),
        ("min_tokens", -1), ("min_tokens", BIG), ("min_tokens", "x"), ("min_tokens", 5),
        ("ignore_eos", "yes"), ("ignore_eos", []),
        ("stream", "yes"), ("stream", []), ("stream", {}),
        ("stream_options", "x"), ("stream_options", {"include_usage": "yes"}), ("stream_options", []),
        ("logit_bias", {"1": 500}), ("logit_bias", {"-1": 5}), ("logit_bias", {"10000000000": 5}),
        ("logit_bias", "x"), ("logit_bias", {"x": "y"}), ("logit_bias", {"x": 1}),
        ("logprobs", "yes"), ("top_logprobs", 5), ("top_logprobs", -1), ("top_logprobs", 21),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        ("response_format", {"type": "json_schema"}), ("response_format", {"type": 5}),
        ("response_format", "json"), ("response_format", {}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tools", "x"), ("tool_choice", 5),
        ("user", 123), ("user", []), ("add_generation_prompt", "no"), ("add_generation_prompt", []),
        ("skip_special_tokens", "no"), ("include_stop_str_in_output", "yes"),
    ]],
    *[Case(f"{k}={v:.30}", content=raw_chat('"Hi"', **{k: v}), headers={"Content-Type": "application/json"})
      for k, v in [
        ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"), ("top_p", "NaN"),
        ("min_p", "NaN"), ("presence_penalty", "Infinity"), ("frequency_penalty", "NaN"),
        ("repetition_penalty", "NaN"), ("repetition_penalty", "Infinity"), ("max_tokens", "NaN"),
        ("top_k", "Infinity"), ("seed", "NaN"), ("temperature", "1e999"), ("top_k", "9" * 100_000),
    ]],
]

COMPLETION_FIELDS = [
    *[Case(f"completions prompt={v!r:.40}", COMPLETIONS, json=completion(prompt=v)) for v in [
        None, 5, [], [[]], "", [""], [1, "a"], ["a", 1], [-1], [10**9], [BIG], [1.5], {"a": 1}, ["a", ""],
        [[1, 2], []], [None], [True], [[-1]], "x" * 200_000,
    ]],
    *[Case(f"completions {k}={v!r:.30}", COMPLETIONS, json=completion(**{k: v})) for k, v in [
        ("echo", 5), ("echo", "yes"), ("best_of", 17), ("best_of", -1), ("suffix", "x"), ("suffix", 5),
        ("logprobs", 6), ("logprobs", -1), ("logprobs", True), ("max_tokens", 0), ("max_tokens", BIG), ("max_tokens", "2"),
        ("top_k", BIG), ("n", 17), ("temperature", "hot"), ("stream", "yes"), ("model", 5),
    ]],
    Case("completions unknown model", COMPLETIONS, json=completion(model="nope"), status=(404,)),
]

MEDIA = [
    *[Case(f"input_audio {name}", json=with_parts(part), code="invalid_media") for name, part in [
        ("bad base64", {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}),
        ("base64 with a NUL", {"type": "input_audio", "input_audio": {"data": "AA\x00A", "format": "wav"}}),
        ("empty data", {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
        ("format m4a", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "m4a"}}),
        ("format wav.", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav."}}),
        ("garbage bytes", audio_part(os.urandom(2000))),
        ("a png as wav", audio_part(PNG)),
        ("garbage mp3", audio_part(b"ID3" + os.urandom(500), "mp3")),
        ("garbage flac", audio_part(b"fLaC" + os.urandom(500), "flac")),
        ("garbage ogg", audio_part(b"OggS" + os.urandom(500), "ogg")),
        ("the first 30 bytes of a wav", audio_part(SPEECH_WAV[:30])),
        ("a wav header and no samples", audio_part(wav_header(16000))),
        ("a wav declaring 0 Hz", audio_part(wav_header(0, data_bytes=400) + bytes(400))),
        ("a wav at 1 Hz, 400 s long", audio_part(wav_header(1, bits=8, data_bytes=400) + bytes(400))),
        ("a wav declaring 1024 channels", audio_part(wav_header(16000, channels=1024, data_bytes=8) + bytes(8))),
        ("301 s of audio", audio_part(LONG_AUDIO)),
        ("a wav of NaN samples", audio_part(wav_bytes(0.1, subtype="FLOAT", fill=float("nan")))),
    ]],
    *[Case(f"image_url {name}", json=with_parts(image_part(url)), code="invalid_media") for name, url in [
        ("data: without a comma", "data:image/png;base64"),
        ("data: without payload", "data:image/png;base64,"),
        ("data: with bad base64", "data:image/png;base64,%%%"),
        ("data: of 3 bytes", "data:image/png;base64,AAAA"),
        ("data: of text", data_url(b"hello, world")),
        ("data: of an svg", data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml")),
        ("a truncated png", data_url(PNG[:60])),
        ("a png declaring 100000x100000", data_url(png_declaring(100_000, 100_000))),
        ("a png declaring 0x0", data_url(png_declaring(0, 0))),
        ("a png 1x5000", data_url(png_bytes(1, 5000))),
        ("a wav as an image", data_url(SPEECH_WAV)),
        ("http URL", "http://example.com/x.png"),
        ("https URL to localhost", "https://127.0.0.1:1/x.png"),
        ("ftp URL", "ftp://example.com/x.png"),
        ("javascript: URL", "javascript:alert(1)"),
        ("file:///etc/passwd", "file:///etc/passwd"),
        ("file URL with a host", "file://otherhost/picture.png"),
        ("../ escape", "../../../../etc/passwd"),
        ("absolute path outside", "/etc/passwd"),
        ("NUL in a path", "picture.png\x00.txt"),
        ("NUL in a file URL", "file:///picture.png%00"),
        ("a missing file", "missing.png"),
        ("the media dir itself", "."),
        ("a symlink out of the media dir", "escape.png"),
        ("a text file", "notes.txt"),
        ("the speech file as an image", "speech.wav"),
    ]],
    *[Case(f"media part {name}", json=with_parts(part)) for name, part in [
        ("audio_url as a string", {"type": "audio_url", "audio_url": "speech.wav"}),
        ("audio_url.url a number", {"type": "audio_url", "audio_url": {"url": 5}}),
        ("audio_url.url empty", {"type": "audio_url", "audio_url": {"url": ""}}),
        ("audio_url to a png", {"type": "audio_url", "audio_url": {"url": "picture.png"}}),
        ("image_url as a string", {"type": "image_url", "image_url": "picture.png"}),
        ("an OpenAI file part", {"type": "file", "file": {"file_id": "file-1"}}),
        ("an input_image part", {"type": "input_image", "image_url": "picture.png"}),
    ]],
    Case("17 attachments", json=with_parts(*[image_part("picture.png")] * 17), code="invalid_media"),
    Case("9 audio attachments", json=with_parts(*[audio_part(wav_bytes(0.5))] * 9), code="invalid_media"),
]

UNICODE = [
    *[Case(f"lone surrogate {name}", content=body, headers={"Content-Type": "application/json"})
      for name, body in [
        ("in content", raw_chat('"\\ud800"')),
        ("low, in content", raw_chat('"a\\udfffb"')),
        ("reversed pair", raw_chat('"\\udc00\\ud800"')),
        ("in a text part", raw_chat('[{"type": "text", "text": "\\ud800"}]')),
        ("streamed", raw_chat('"\\ud800"', stream="true")),
        ("in the name", raw_chat('"Hi"').replace(b'"role": "user"', b'"role": "user", "name": "\\ud800"')),
        ("in the model", raw_chat('"Hi"').replace(f'"{MODEL}"'.encode(), b'"\\ud800"')),
        ("in stop", raw_chat('"Hi"', stop='"\\ud800"')),
        ("in user", raw_chat('"Hi"', user='"\\ud800"')),
        ("in an image path", raw_chat('[{"type": "image_url", "image_url": {"url": "\\ud800.png"}}]')),
        ("in base64 audio",
         raw_chat('[{"type": "input_audio", "input_audio": {"data": "\\ud800", "format": "wav"}}]')),
    ]],
    *[Case(f"completions lone surrogate {name}", COMPLETIONS, content=body,
           headers={"Content-Type": "application/json"}) for name, body in [
        ("in prompt", raw_completion('"\\ud800"')),
        ("in a prompt list", raw_completion('["\\udbff"]')),
        ("streamed", raw_completion('"a\\ud800"', stream="true")),
    ]],
    *[Case(f"bytes {name}", content=raw_chat('"X"').replace(b'"X"', raw),
           headers={"Content-Type": "application/json"}) for name, raw in [
        ("not UTF-8", b'"caf\xe9"'),
        ("UTF-8 encoded surrogate", b'"\xed\xa0\x80"'),
        ("overlong UTF-8", b'"\xc0\xaf"'),
        ("a raw control character", b'"a\x01b"'),
        ("a raw newline in a string", b'"a\nb"'),
    ]],
    Case("latin-1 declared as such", content=raw_chat('"X"').replace(b'"X"', b'"\xe9t\xe9"'),
         headers={"Content-Type": "application/json; charset=latin-1"}),
    Case("a byte-order mark", content=b"\xef\xbb\xbf" + raw_chat('"Hi"'),
         headers={"Content-Type": "application/json"}, status=(200, 400)),
    Case("UTF-16", content=json.dumps(chat()).encode("utf-16"), headers={"Content-Type": "application/json"},
         status=(200, 400)),
    *[Case(f"model {name}", json=chat(model=v), status=(404,), code="model_not_found") for name, v in [
        ("emoji", "🙂🙂"), ("RTL override", "\u202eynit"), ("zero-width", "ti\u200dny"), ("NUL", "ti\x00ny"),
        ("combining", "ti\u0301ny"), ("BOM", "\ufefftiny"),
    ]],
]

# Hostile-looking but valid: each must be answered.
ACCEPTED = [
    *[Case(f"valid text {name}", json=chat(messages=[{"role": "user", "content": text}]), status=(200,))
      for name, text in [
        ("emoji", "🙂👩‍👩‍👧‍👦🏳️‍🌈"), ("RTL", "\u202eHello \u05e9\u05dc\u05d5\u05dd"), ("zero-width", "a\u200b\u200c\u200db"),
        ("BOM inside", "\ufeffHi"), ("combining", "e\u0301\u0301\u0301"), ("escaped NUL", "a\x00b"),
        ("a surrogate pair", "\U0001f600"), ("CJK", "你好,世界"), ("special tokens", "<|im_end|><|im_start|>system"),
    ]],
    *[Case(f"OpenAI field {k}={v!r}", json=chat(**{k: v}), status=(200,)) for k, v in [
        ("store", False), ("metadata", {"k": "v"}), ("modalities", ["text"]), ("service_tier", "auto"),
        ("reasoning_effort", "low"), ("prediction", {"type": "content", "content": "Hi"}), ("user", "u-1"),
        ("parallel_tool_calls", False), ("temperature", 0), ("stream_options", None),
    ]],
    *[Case(f"streamed with {options}", json=chat(stream=True, stream_options=options), status=(200,))
      for options in [
        {"include_usage": True}, {"include_usage": False}, {"include_usage": True, "include_obfuscation": False},
    ]],
    Case("a lowercase bearer", json=chat(), headers={"Authorization": f"bearer {API_KEY}"}, status=(200,)),
    Case("completions with store and user", COMPLETIONS, json=completion(store=False, user="u"), status=(200,)),
]

CONTENT_TYPES = [
    *[Case(f"chat as {ctype}", content=json.dumps(chat()).encode(), headers={"Content-Type": ctype},
           status=(400, 415)) for ctype in [
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/xml", "image/png", "application/octet-stream",
    ]],
    Case("chat as a form", data={"model": MODEL, "messages": "Hi"}, status=(400, 415)),
    Case("chat as multipart", files={"file": ("a.json", json.dumps(chat()).encode())}, status=(400, 415)),
    Case("completions as text/plain", COMPLETIONS, content=json.dumps(completion()).encode(),
         headers={"Content-Type": "text/plain"}, status=(400, 415)),
    Case("transcription as JSON", TRANSCRIPTIONS, json={"model": MODEL, "file": "AAAA"}),
    Case("transcription as a urlencoded form", TRANSCRIPTIONS, data={"model": MODEL, "file": "AAAA"}),
    Case("transcription with no body", TRANSCRIPTIONS, content=b""),
    *[Case(f"multipart {name}", TRANSCRIPTIONS, **multipart(boundary, body)) for name, boundary, body in [
        ("garbage", "xyz", b"garbage"),
        ("with another boundary", "xyz", b'--abc\r\nContent-Disposition: form-data; name="m"\r\n\r\nx\r\n--abc--\r\n'),
        ("truncated", "xyz", form_part("file", b"RIFF", "a.wav")[:-2]),
        ("a part without headers", "xyz", b"--xyz\r\n\r\ndata\r\n--xyz--\r\n"),
        ("a part without a name", "xyz", b"--xyz\r\nContent-Disposition: form-data\r\n\r\ndata\r\n--xyz--\r\n"),
        ("only the end", "xyz", b"--xyz--\r\n"),
        ("NUL bytes", "xyz", bytes(1000)),
        ("an empty boundary", "", b"----\r\n"),
    ]],
    # Form fields are decoded with replacement characters: a bad byte in one is harmless.
    Case("multipart with a UTF-8 encoded surrogate in the prompt", TRANSCRIPTIONS, status=(200, 400), **multipart(
        "xyz", form_part("model", MODEL.encode()) + form_part("max_tokens", b"2")
        + form_part("prompt", b"\xed\xa0\x80") + form_part("file", SPEECH_WAV, "a.wav") + b"--xyz--\r\n")),
    Case("multipart without a boundary", TRANSCRIPTIONS, content=b"--x\r\n\r\n",
         headers={"Content-Type": "multipart/form-data"}),
]

TRANSCRIPTION_FIELDS = [
    transcription("no file", file=None),
    transcription("no model", model=None),
    transcription("an unknown model", model="nope", status=(404,)),
    transcription("an empty file", file=b""),
    transcription("a garbage file", file=os.urandom(3000)),
    transcription("a png", file=PNG),
    transcription("the first 30 bytes of a wav", file=SPEECH_WAV[:30]),
    transcription("a wav header and no samples", file=wav_header(16000)),
    transcription("a wav at 1 Hz, 400 s long", file=wav_header(1, bits=8, data_bytes=400) + bytes(400)),
    transcription("301 s of audio", file=LONG_AUDIO),
    transcription("a file over the body limit", file=bytes(MAX_BODY_BYTES + 1000), status=(413,)),
    transcription("response_format srt", response_format="srt", status=(200,)),
    transcription("response_format vtt", response_format="vtt", status=(200,)),
    Case("a translation of garbage", "/v1/audio/translations", data={"model": MODEL, "max_tokens": "2"},
         files={"file": ("clip.wav", os.urandom(3000), "audio/wav")}, status=(400,)),
    Case("a translation as srt", "/v1/audio/translations",
         data={"model": MODEL, "max_tokens": "2", "response_format": "srt"},
         files={"file": ("clip.wav", SPEECH_WAV, "audio/wav")}, status=(200,)),
    Case("a translation with language", "/v1/audio/translations",
         data={"model": MODEL, "max_tokens": "2", "language": "en"},
         files={"file": ("clip.wav", SPEECH_WAV, "audio/wav")}, status=(200,)),
    transcription("response_format 5", response_format="5"),
    transcription("temperature hot", temperature="hot"),
    transcription("temperature nan", temperature="nan"),
    transcription("temperature inf", temperature="inf"),
    transcription("temperature -1", temperature="-1"),
    transcription("max_tokens -1", max_tokens="-1"),
    transcription("max_tokens 0", max_tokens="0"),
    transcription("max_tokens beyond int64", max_tokens=str(BIG)),
    transcription("max_tokens abc", max_tokens="abc"),
    transcription("min_tokens beyond int64", min_tokens=str(10**30)),
    transcription("seed beyond int64", seed=str(2**64)),
    transcription("stream maybe", stream="maybe"),
    transcription("ignore_eos maybe", ignore_eos="maybe"),
    Case("the file as a text field", TRANSCRIPTIONS, data={"model": MODEL, "file": "not a file"}),
]

SIZES = [
    Case("a body over the limit", json=chat(messages=[{"role": "user", "content": "a" * MAX_BODY_BYTES}]),
         status=(413,), code="body_too_large"),
    Case("a chunked body over the limit", content=iter([b" " * (MAX_BODY_BYTES // 4)] * 5),
         headers={"Content-Type": "application/json"}, status=(413,)),
    Case("a text prompt past the context", json=chat(messages=[{"role": "user", "content": "hello " * 150_000}]),
         code="request_too_large"),
    Case("5000 messages past the context", json=chat(messages=[{"role": "user", "content": "hi"}] * 5000),
         code="request_too_large"),
    Case("completions token ids past the context", COMPLETIONS, json=completion(prompt=list(range(1, 3000))),
         code="request_too_large"),
    Case("max_tokens past the context", json=chat(max_tokens=MAX_MODEL_LEN * 4), code="request_too_large"),
    Case("min_tokens past max_tokens", json=chat(max_tokens=2, min_tokens=3)),
    Case("20000 text parts", json=chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 20_000}]),
         status=(200, 400)),
    Case("a 5000-digit float", content=raw_chat('"Hi"', temperature="0." + "1" * 5000),
         headers={"Content-Type": "application/json"}, status=(200, 400)),
]

AUTH = [
    *[Case(f"{p} without a key", p, method=m, auth=False, status=(401,), code="invalid_api_key")
      for m, p in [("POST", CHAT), ("POST", COMPLETIONS), ("POST", TRANSCRIPTIONS), ("GET", "/v1/models"),
                   ("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/nope")]],
    *[Case(f"Authorization {value!r:.40}", json=chat(), headers={"Authorization": value}, auth=False,
           status=(401,), code="invalid_api_key") for value in [
        "Bearer wrong", "Bearer", f"Basic {base64.b64encode(b'user:' + API_KEY.encode()).decode()}",
        f"Token {API_KEY}", API_KEY, f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", f"Bearer{API_KEY}",
        f"Bearer {API_KEY} {API_KEY}", f"Bearer {API_KEY},Bearer {API_KEY}", "Bearer " + "k" * 8000,
        "Bearer clé".encode(), "Bearer 🔑".encode(), f"Bearer {API_KEY}\u200b".encode(), b"Bearer sk-\xe9",
        f"Bearer {API_KEY}é".encode("latin-1"),
    ]],
    Case("a wrong key and a broken body", content=b"{", headers={"Authorization": "Bearer x"}, auth=False,
         status=(401,)),
    # the playground's page is public: the calls it makes carry the key
    *[Case(f"{p} without a key", p, method="GET", auth=False, status=(200,))
      for p in ["/", "/playground", "/playground/app.js", "/playground/style.css"]],
]

# Without a key or a media directory: what the defaults refuse, and what they let through.
DEFAULTS = [
    Case("a local path without --media-dir", json=with_parts(image_part("picture.png")), code="invalid_media"),
    Case("a file URL without --media-dir", json=with_parts(image_part("file:///etc/passwd")), code="invalid_media"),
    Case("a NUL path without --media-dir", json=with_parts(image_part("a\x00b")), code="invalid_media"),
    Case("an http URL without --allow-remote-media", json=with_parts(image_part("http://127.0.0.1:1/x.png")),
         code="invalid_media"),
    Case("no key needed", json=chat(), auth=False, status=(200,)),
    Case("a stray Authorization header", json=chat(), headers={"Authorization": "Basic 🔑".encode()}, auth=False,
         status=(200,)),
    Case("the models without a key", "/v1/models", method="GET", auth=False, status=(200,)),
    Case("a wrong method", "/v1/models", method="POST", auth=False, status=(405,)),
]

# fmt: on

BATCHES = [
    ROUTES, JSON_BODIES, CHAT_FIELDS, SAMPLING, COMPLETION_FIELDS, MEDIA, UNICODE, ACCEPTED, CONTENT_TYPES,
    TRANSCRIPTION_FIELDS, SIZES, AUTH, DEFAULTS,
]  # fmt: skip


# -- servers ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus-media")
    for name, data in MEDIA_DIR_FILES.items():
        (root / name).write_bytes(data)
    outside = root.parent / "outside.png"
    shutil.copy(root / "picture.png", outside)
    (root / "escape.png").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def server(launch_server, media_dir):
    with launch_server(
        "corpus-server",
        "--served-model-name", MODEL,
        "--api-key", API_KEY,
        "--media-dir", str(media_dir),
        "--num-kv-pages", str(MAX_MODEL_LEN // 16),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-body-bytes", str(MAX_BODY_BYTES),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    # One keep-alive connection for the whole corpus: a request that breaks it fails as a TransportError.
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def assert_healthy(server, client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = client.post(CHAT, json=chat(max_tokens=3, min_tokens=3, ignore_eos=True), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    server.wait_pages_free(timeout=5)


def ids(cases: list[Case]) -> list[str]:
    return [c.name.encode("ascii", "backslashreplace").decode() for c in cases]


def test_the_corpus_is_large_and_its_names_unique():
    names = [c.name for cases in BATCHES for c in cases]
    assert len(names) >= 200
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("case", ROUTES, ids=ids(ROUTES))
def test_routes(client, case):
    check(client, case)


def test_healthy_after_routes(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", JSON_BODIES, ids=ids(JSON_BODIES))
def test_json_bodies(client, case):
    check(client, case)


def test_healthy_after_json_bodies(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", CHAT_FIELDS, ids=ids(CHAT_FIELDS))
def test_chat_fields(client, case):
    check(client, case)


def test_healthy_after_chat_fields(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", SAMPLING, ids=ids(SAMPLING))
def test_sampling_fields(client, case):
    check(client, case)


def test_healthy_after_sampling_fields(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", COMPLETION_FIELDS, ids=ids(COMPLETION_FIELDS))
def test_completion_fields(client, case):
    check(client, case)


def test_healthy_after_completion_fields(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", MEDIA, ids=ids(MEDIA))
def test_media(client, case):
    check(client, case)


def test_healthy_after_media(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", UNICODE, ids=ids(UNICODE))
def test_unicode(client, case):
    check(client, case)


def test_healthy_after_unicode(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", ACCEPTED, ids=ids(ACCEPTED))
def test_accepted(client, case):
    check(client, case)


def test_healthy_after_accepted(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", CONTENT_TYPES, ids=ids(CONTENT_TYPES))
def test_content_types(client, case):
    check(client, case)


def test_healthy_after_content_types(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", TRANSCRIPTION_FIELDS, ids=ids(TRANSCRIPTION_FIELDS))
def test_transcription_fields(client, case):
    check(client, case)


def test_healthy_after_transcription_fields(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", SIZES, ids=ids(SIZES))
def test_sizes(client, case):
    check(client, case)


def test_healthy_after_sizes(server, client):
    assert_healthy(server, client)


@pytest.mark.parametrize("case", AUTH, ids=ids(AUTH))
def test_auth(client, case):
    check(client, case)


def test_healthy_after_auth(server, client):
    assert_healthy(server, client)


@pytest.fixture(scope="module")
def open_server(shared_server):
    """Neither --api-key nor --media-dir: the defaults."""
    return shared_server


@pytest.mark.parametrize("case", DEFAULTS, ids=ids(DEFAULTS))
def test_defaults(open_server, case):
    with httpx.Client(base_url=open_server.url, timeout=30) as client:
        check(client, case)


def test_healthy_after_defaults(open_server):
    with httpx.Client(base_url=open_server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        answer = client.post(CHAT, json=chat(max_tokens=3, min_tokens=3, ignore_eos=True))
        assert answer.json()["usage"]["completion_tokens"] == 3
    open_server.wait_pages_free(timeout=5)
