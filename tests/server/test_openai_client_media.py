"""A live `omnistage serve --media-dir` (tiny checkpoint, CPU): audio and images through the openai client."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.server.conftest import SHARED_MODEL

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
FORCED = {"min_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(shared_media_server):
    return shared_media_server  # its media directory holds speech.wav


@pytest.fixture(scope="module")
def model() -> str:
    return SHARED_MODEL


def png_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), (10, 120, 200)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def speech_part() -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(SPEECH.read_bytes()).decode(), "format": "wav"},
    }


def ask(client, model, *parts, **extra):
    content = [*parts, {"type": "text", "text": "Describe what you hear and see."}]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0,
        extra_body=FORCED, **extra,
    )  # fmt: skip


def test_audio_and_image_in_one_chat(client, model):
    result = ask(client, model, speech_part(), {"type": "image_url", "image_url": {"url": png_data_url()}})
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 6
    # 2.98 s of audio and a 56x84 image expand to many placeholders: the prompt is far longer than its text.
    assert result.usage.prompt_tokens > 60


def test_audio_streams(client, model):
    chunks = list(ask(client, model, speech_part(), stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6


def test_audio_from_the_media_dir(client, model):
    local = ask(client, model, {"type": "audio_url", "audio_url": {"url": "speech.wav"}})
    inline = ask(client, model, speech_part())
    assert local.usage.prompt_tokens == inline.usage.prompt_tokens
    assert local.choices[0].message.content == inline.choices[0].message.content


@pytest.mark.parametrize("response_format", ["json", "text", "verbose_json"])
def test_transcriptions(client, model, response_format):
    result = client.audio.transcriptions.create(
        file=SPEECH.open("rb"), model=model, response_format=response_format, extra_body={"max_tokens": 6}
    )
    if response_format == "text":
        assert isinstance(result, str)
    else:
        assert isinstance(result.text, str)
    if response_format == "verbose_json":
        assert result.duration == 2.98 and result.task == "transcribe"


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "m4a"}}, "'m4a' is not supported"),
        (
            {"type": "input_audio", "input_audio": {"data": "AAAAAAAA", "format": "wav"}},
            "audio could not be decoded",
        ),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio is empty"),
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "--allow-remote-media"),
        ({"type": "audio_url", "audio_url": {"url": "../speech.wav"}}, "outside the media directory"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            "image could not be decoded",
        ),
    ],
)
def test_bad_media_is_400(client, model, part, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        ask(client, model, part)
    assert caught.value.body["code"] == "invalid_media"


def test_too_many_attachments_is_400(client, model):
    with pytest.raises(openai.BadRequestError, match=r"too many audio attachments: 9 \(the limit is 8\)"):
        ask(client, model, *[speech_part()] * 9)


@pytest.mark.parametrize("endpoint", ["chat", "transcriptions"])
def test_bench_a2t_against_the_server(server, model, endpoint):
    from omnistage.bench import a2t
    from omnistage.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "a2t", "--url", server.url, "--endpoint", endpoint, "--limit", "3", "--no-espeak",
         "--output-tokens", "4", "--concurrency", "1,3"]
    )  # fmt: skip
    results = a2t.run_a2t(args)
    assert results["target"] == {"url": server.url, "model": model, "endpoint": endpoint, "client": "h11"}
    for p in results["ours"]:
        assert p["requests"] == 3 and p["output_tokens"] == 12
        assert p["rtf"] > 0 and 0 < p["ttft_median_ms"] <= p["latency_median_ms"]
