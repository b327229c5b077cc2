"""Media content parts in chat completions, in-process on the fake engine: decoding, policy and every 400."""

from __future__ import annotations

import base64
import io
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient
from PIL import Image

from omnistage.media import MediaPolicy
from omnistage.server import build_app

MODEL = "fake-model"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"


def wav_bytes(seconds: float, rate: int = 16000, fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    t = np.arange(round(seconds * rate)) / rate
    sf.write(buffer, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format=fmt)
    return buffer.getvalue()


def png_bytes(width: int = 64, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def app_client(fake_pipeline, **policy) -> TestClient:
    return TestClient(build_app(fake_pipeline, MODEL, media=MediaPolicy(**policy)))


@pytest.fixture
def client(fake_pipeline) -> TestClient:
    return app_client(fake_pipeline, max_audio_seconds=5.0, max_attachments=4)


def chat(client: TestClient, *parts: dict, max_tokens: int = 200) -> object:
    content = [*parts, {"type": "text", "text": "What is this?"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return client.post("/v1/chat/completions", json=body)


def assert_400(response, *needles: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error["message"]


def test_audio_and_image_reach_the_processor_decoded(client, fake_pipeline):
    image_url = f"data:image/png;base64,{b64(png_bytes(64, 32))}"
    r = chat(client, audio_part(SPEECH.read_bytes()), image_part(image_url))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "<audio 2.98s><image 64x32>What is this?"
    mrope, mm = fake_pipeline.last_media
    assert mrope == "mrope" and len(mm) == 2
    assert mm[0].dtype == np.float32 and len(mm[0]) == 47676  # the file's 2.98 s at 16 kHz


def test_base64_with_line_breaks_and_spaces_decodes_as_without(client, fake_pipeline):
    """Clean base64 takes the one-pass strict decoder; pasted base64 (wrapped lines, spaces) the tolerant path,
    to the same samples."""
    data = b64(SPEECH.read_bytes())
    wrapped = "\n".join(data[i : i + 76] for i in range(0, len(data), 76)) + " "
    decoded = []
    for text in (data, wrapped):
        part = {"type": "input_audio", "input_audio": {"data": text, "format": "wav"}}
        assert chat(client, part).status_code == 200
        decoded.append(fake_pipeline.last_media[1][0])
    np.testing.assert_array_equal(*decoded)


def test_audio_is_resampled_to_16k_and_flac_and_ogg_decode(client, fake_pipeline):
    for fmt, container in (("wav", "WAV"), ("flac", "FLAC"), ("ogg", "OGG")):
        r = chat(client, audio_part(wav_bytes(1.5, rate=44100, fmt=container), fmt))
        assert r.json()["choices"][0]["message"]["content"].startswith("<audio 1.50s>"), (fmt, r.text)
        assert len(fake_pipeline.last_media[1][0]) == 24000


def test_audio_url_with_a_data_url(client):
    r = chat(
        client, {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64(wav_bytes(1.0))}"}}
    )
    assert r.json()["choices"][0]["message"]["content"].startswith("<audio 1.00s>")


def test_text_only_chat_keeps_the_text_path(client, fake_pipeline):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "hi"
    assert fake_pipeline.last_media == (None, None)


def test_streaming_with_media(client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [audio_part(wav_bytes(1.0))]}],
        "max_tokens": 6,
        "stream": True,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert '"content":"<"' in r.text


@pytest.mark.parametrize(
    ("part", "needles"),
    [
        (
            {"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}},
            ["messages[0].content[0]: the data is not valid base64"],
        ),
        (
            audio_part(wav_bytes(1.0), "aac"),
            ["input_audio.format 'aac' is not supported; use one of wav, mp3"],
        ),
        (audio_part(b"RIFF this is not a wave file"), ["audio could not be decoded"]),
        (audio_part(b""), ["audio is empty (0 bytes)"]),
        (audio_part(wav_bytes(0.0)), ["audio holds no samples"]),
        (audio_part(wav_bytes(6.0)), ["audio is too long: 6.0 s, the limit is 5 s per clip"]),
        (image_part("data:image/png;base64," + b64(b"\x89PNG broken")), ["image could not be decoded"]),
        (image_part("data:image/png;base64,@@@"), ["not valid base64"]),
        (image_part("data:image/png;base64"), ["the data: URL has no ','"]),
        (
            image_part("https://example.com/cat.png"),
            ["remote media URLs are disabled", "--allow-remote-media"],
        ),
        (image_part("/etc/passwd"), ["local media paths are disabled", "--media-dir"]),
        (image_part("ftp://example.com/cat.png"), ["URL scheme 'ftp' is not supported"]),
        ({"type": "image_url", "image_url": {"url": ""}}, ["image_url.url is missing"]),
    ],
)
def test_bad_media_is_400_with_its_message(client, part, needles):
    assert_400(chat(client, part), *needles)


def test_missing_payload_names_the_field(client):
    message = assert_400(
        chat(client, {"type": "input_audio"}), "input_audio parts need their 'input_audio' field"
    )
    assert message.startswith("invalid request: messages[0].content[0]")


def test_too_many_attachments(fake_pipeline):
    server_side = app_client(fake_pipeline, max_attachments=2)
    parts = [audio_part(wav_bytes(0.5))] * 3
    assert_400(chat(server_side, *parts), "too many attachments: 3, the limit is 2 per request")
    processor_side = app_client(fake_pipeline)  # the fake processor takes at most 3
    assert_400(chat(processor_side, *[audio_part(wav_bytes(0.5))] * 4), "too many attachments: 4")


@pytest.fixture
def media_dir(tmp_path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "clip.wav").write_bytes(wav_bytes(1.25))
    (root / "pic.png").write_bytes(png_bytes(40, 20))
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    return root


def test_local_files_only_under_media_dir(fake_pipeline, media_dir):
    client = app_client(fake_pipeline, media_dir=media_dir)
    audio = {"type": "audio_url", "audio_url": {"url": "sub/clip.wav"}}
    assert chat(client, audio).json()["choices"][0]["message"]["content"].startswith("<audio 1.25s>")
    r = chat(client, image_part(f"file://{media_dir / 'pic.png'}"))
    assert r.json()["choices"][0]["message"]["content"].startswith("<image 40x20>")
    for outside in (
        "../secret.png",
        str(media_dir.parent / "secret.png"),
        "escape.png",
        "sub/../../secret.png",
    ):
        assert_400(chat(client, image_part(outside)), "is outside the media directory", "--media-dir")
    assert_400(chat(client, image_part("nope.png")), "nope.png does not exist in the media directory")
    assert_400(chat(client, image_part("file://otherhost/pic.png")), "names a host")


@pytest.fixture
def http_media(media_dir):
    handler = partial(SimpleHTTPRequestHandler, directory=str(media_dir))
    handler.log_message = lambda *a: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_media_with_the_flag(fake_pipeline, http_media):
    client = app_client(fake_pipeline, allow_remote=True, max_bytes=50_000)
    r = chat(client, image_part(f"{http_media}/pic.png"))
    assert r.json()["choices"][0]["message"]["content"].startswith("<image 40x20>")
    assert_400(chat(client, image_part(f"{http_media}/missing.png")), "answered HTTP 404")
    big = app_client(fake_pipeline, allow_remote=True, max_bytes=50)
    assert_400(chat(big, image_part(f"{http_media}/pic.png")), "larger than the limit of 50 bytes")
