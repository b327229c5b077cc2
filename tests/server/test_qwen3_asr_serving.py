"""A Qwen3-ASR checkpoint served by `build_app` as readily as a Qwen3-Omni one (tiny checkpoint, CPU), and by a live
`omnistage serve` to the openai client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import re
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage.bench.server_process import ServerProcess
from omnistage.config import engine_config
from omnistage.models.qwen3_asr.tiny import make_tiny
from omnistage.models.qwen3_omni.transcription import max_transcription_tokens
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.server import build_app

MODEL = "asr"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
CONTEXT = 65_536  # the tiny checkpoint's, the released one's
BOUND = CONTEXT * 128  # bytes of text the context can hold: 128 spaces are Qwen's longest token


def wav(seconds: float) -> bytes:
    t = np.arange(int(seconds * 16000)) / 16000
    samples = (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, samples, 16000, format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("asr"))


@pytest.fixture(scope="module")
def client(checkpoint):
    # pages for the whole context (65,536 tokens): the text bounds below are the model's, not a small pool's
    engine = AsyncPipeline.from_config(
        engine_config(model=str(checkpoint), device="cpu", num_kv_pages=65536 // 16)
    )
    try:
        yield TestClient(build_app(engine, MODEL))
    finally:
        engine.shutdown()


def words(size: int) -> str:
    """`size` characters of random lowercase words: about two characters per token, no tokenizer cache luck."""
    rng = random.Random(0)
    vocabulary = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 12))) for _ in range(20000)
    ]
    text = " ".join(rng.choices(vocabulary, k=size // 6))
    return (text * (size // len(text) + 1))[:size]


def audio_part(seconds: float) -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav(seconds)).decode(), "format": "wav"},
    }


def text_request(endpoint: str, text: str) -> tuple[str, dict]:
    """The path and body of a request carrying `text`: a chat's context (its system turn) or a completions prompt."""
    if endpoint == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}
    messages = [{"role": "system", "content": text}, {"role": "user", "content": [audio_part(1.0)]}]
    return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}


def probing_health(app: FastAPI, path: str, body: dict) -> tuple[float, float, httpx.Response]:
    """Send `body` to `path`, probing /health every 20 ms until it is answered: its seconds, the longest wait
    between /health's answers, and its response."""

    async def scenario() -> tuple[float, float, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as probe:
            started = time.monotonic()
            request = asyncio.create_task(probe.post(path, json=body))
            gap, last = 0.0, time.monotonic()
            while not request.done():
                assert (await probe.get("/health")).status_code == 200
                gap, last = max(gap, time.monotonic() - last), time.monotonic()
                await asyncio.sleep(0.02)
            return time.monotonic() - started, gap, await request

    return asyncio.run(scenario())


def transcribe(client: TestClient, **form) -> dict | str:
    files = {"file": ("clip.wav", wav(1.5), "audio/wav")}
    response = client.post(TRANSCRIPTIONS, data={"model": MODEL, "max_tokens": "8", **form}, files=files)
    assert response.status_code == 200, response.text
    return response.text if form.get("response_format") in ("text", "srt", "vtt") else response.json()


def test_transcriptions_in_every_format(client):
    text = transcribe(client)["text"]
    verbose = transcribe(client, response_format="verbose_json")
    assert verbose["text"] == text and verbose["task"] == "transcribe" and verbose["duration"] == 1.5
    assert "<asr_text>" not in text  # the reply is read: language header off, transcript kept
    assert transcribe(client, response_format="text") == text


def test_subtitles_hold_the_transcript_and_translations_are_a_400(client):
    text = transcribe(client)["text"]
    srt = transcribe(client, response_format="srt")
    assert isinstance(srt, str) and srt.startswith("1\n00:00:00,000 --> ") and "00:00:01,500\n" in srt
    assert " ".join(line for line in srt.splitlines()[2::4]) == text.strip()
    files = {"file": ("clip.wav", wav(1.0), "audio/wav")}
    response = client.post("/v1/audio/translations", data={"model": MODEL}, files=files)
    assert response.status_code == 400
    assert "this model transcribes only" in response.json()["error"]["message"]


def test_a_forced_language_is_reported_and_an_unknown_one_is_a_400(client):
    assert transcribe(client, language="en", response_format="verbose_json")["language"] == "english"
    files = {"file": ("clip.wav", wav(1.0), "audio/wav")}
    response = client.post(TRANSCRIPTIONS, data={"model": MODEL, "language": "xx"}, files=files)
    assert response.status_code == 400
    assert "language 'xx' is not one this model transcribes" in response.json()["error"]["message"]
    assert "en (English)" in response.json()["error"]["message"]


def test_a_streamed_transcription_adds_up_to_its_done_event(client):
    files = {"file": ("clip.wav", wav(1.5), "audio/wav")}
    form = {"model": MODEL, "max_tokens": "8", "stream": "true"}
    with client.stream("POST", TRANSCRIPTIONS, data=form, files=files) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta")
    done = [e for e in events if e["type"] == "transcript.text.done"]
    assert len(done) == 1 and done[0]["text"] == deltas == transcribe(client)["text"]


def test_chat_with_audio_transcribes_and_other_asks_are_400s(client):
    audio = {"data": base64.b64encode(wav(1.0)).decode(), "format": "wav"}
    chat = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]}],
    }
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6
    text_only = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    response = client.post("/v1/chat/completions", json=text_only)
    assert response.status_code == 400 and "needs one audio part" in response.json()["error"]["message"]
    spoken = {**chat, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
    response = client.post("/v1/chat/completions", json=spoken)
    assert response.status_code == 400
    response = client.post("/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "ethan"})
    assert response.status_code == 400


def test_the_openai_client_transcribes_through_a_live_server(checkpoint, client, tmp_path):
    """`omnistage serve --model <a Qwen3-ASR checkpoint>` in a process of its own, the openai client over HTTP:
    the transcript, language and duration the in-process app gives for the same clip."""
    args = [
        "--model",
        str(checkpoint),
        "--device",
        "cpu",
        "--served-model-name",
        MODEL,
        "--log-level",
        "warning",
    ]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        api = openai.OpenAI(base_url=f"{server.wait_ready().url}/v1", api_key="none", max_retries=0)
        result = api.audio.transcriptions.create(
            model=MODEL,
            file=("clip.wav", wav(1.5), "audio/wav"),
            language="en",
            response_format="verbose_json",
            extra_body={"max_tokens": 8},
        )
    finally:
        server.stop()
    expected = transcribe(client, language="en", response_format="verbose_json")
    assert (result.text, result.language, result.duration) == (
        expected["text"],
        expected["language"],
        expected["duration"],
    )
    assert result.language == "english" and result.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(client, endpoint):
    """As a Qwen3-Omni server does (test_prompt_size.py): a 400 by the text's size, at once, /health answering."""
    took, gap, response = probing_health(client.app, *text_request(endpoint, words(BOUND + 1)))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    size = re.match(
        rf"the prompt is ([\d,]+) bytes of text; the model's context of {CONTEXT:,} tokens holds at most {BOUND:,}",
        error["message"],
    )
    assert size and int(size[1].replace(",", "")) > BOUND, error
    # Tokenizing 8 MiB took 5.5-8.4 s on the CPU machine; reading and measuring it takes little.
    assert took < 2, took
    assert gap < 1, gap


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_health_answers_while_a_large_text_is_tokenized(client, endpoint):
    text = words(3_000_000)  # within the bound, so it is tokenized (for a few CPU seconds), over the context
    took, gap, response = probing_health(client.app, *text_request(endpoint, text))
    assert response.status_code == 400, response.text
    assert f"tokens; the model's context is {CONTEXT:,} tokens" in response.json()["error"]["message"]
    assert took > 0.5, took  # long enough for the probes to overlap the tokenizing
    assert gap < 0.5, f"/health went unanswered for {gap:.2f} s during a {took:.2f} s tokenization"


def test_a_chat_without_max_tokens_is_capped_as_the_transcription_of_its_clip(client):
    """A chat to Qwen3-ASR is a transcription: without max_tokens it stops where the clip's transcription does,
    not at the context; a max_tokens given is honoured."""
    forced = {"ignore_eos": True, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [audio_part(1.5)]}], **forced}
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_transcription_tokens(1.5)
    files = {"file": ("clip.wav", wav(1.5), "audio/wav")}
    form = {"model": MODEL, "stream": "true", "ignore_eos": "true"}
    events = client.post(TRANSCRIPTIONS, data=form, files=files).text.split("\n\n")
    done = json.loads([e for e in events if e.startswith("data: {")][-1].removeprefix("data: "))
    assert done["usage"]["output_tokens"] == max_transcription_tokens(1.5)
    response = client.post("/v1/chat/completions", json=chat | {"max_tokens": 5})
    assert response.json()["usage"]["completion_tokens"] == 5
