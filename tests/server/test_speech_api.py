"""Speech out over HTTP, as OpenAI clients ask for it: chat with `modalities` "audio" and /v1/audio/speech.

In-process over a fake pipeline that speaks (its audio is seeded noise, one codec frame per text token), for
the shapes, the checks and the failures; the live tests against `omnistage serve` follow at the end.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile
from fastapi.testclient import TestClient

from omnistage.errors import InvalidRequest
from omnistage.outputs import AUDIO_SAMPLE_RATE, CompletionOutput, RequestOutput
from omnistage.pipeline.async_pipeline import Preparing
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server import build_app
from omnistage.server.speech import AudioCut
from tests.server.conftest import SHARED_MODEL

MODEL = "fake-model"
VOICES = ("aiden", "chelsie", "ethan")
FRAME = AUDIO_SAMPLE_RATE * 2 // 25  # samples of one codec frame (12.5 frames per second)
MESSAGES = [{"role": "user", "content": "Say hello"}]
SPOKEN = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


@dataclass
class TtsPrompt:
    prompt: str
    token_ids: list[int]
    reply_token_ids: list[int]


class SpeakingProcessor:
    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        max_model_len: int,
        template_kwargs: dict,
        tools=None,
    ):
        prompt = "\n".join(m["content"] for m in messages)
        return prompt, [ord(c) for c in prompt]


def tts_prompt(text: str) -> TtsPrompt:
    return TtsPrompt(f"<speak>{text}", [1, 2, *map(ord, text)], [ord(c) for c in text])


@dataclass
class SpeakingPipeline:
    """Echoes the prompt one character per step (or, given a reply, speaks it); each step of a speaking
    request carries one frame of noise drawn from the talker's seed. A prompt holding "fail" ends in an
    error after two steps, one holding "crash" raises after two steps."""

    voices: tuple[str, ...] = VOICES
    ready: bool = True
    calls: list[tuple[list[int], SamplingParams, SpeechParams | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.frontend = Frontend(Path("/models/fake"), 4096, SpeakingProcessor(), tts_prompt, self.voices)

    def preparing(self) -> Preparing:
        return Preparing(self)

    def _prepared(self) -> None:
        """The server's count of requests being prepared: an engine that never holds a burst keeps none."""

    def stats(self) -> dict[str, int]:
        return {
            "num_waiting": 0,
            "num_running": 0,
            "kv_pages_total": 8,
            "kv_pages_free": 8,
            "kv_pages_used": 0,
        }

    async def generate(
        self, request: GenerationRequest, preparing: Preparing | None = None
    ) -> AsyncIterator[RequestOutput]:
        if preparing is not None:
            preparing.done()
        request_id, prompt, prompt_token_ids = request.request_id, request.prompt, request.prompt_token_ids
        params, speech = request.params, request.speech
        self.calls.append((prompt_token_ids, params, speech))
        if speech is not None and speech.voice not in self.voices:
            raise InvalidRequest(f"unknown voice {speech.voice!r}")
        given = speech is not None and speech.reply_token_ids is not None
        reply = "".join(map(chr, speech.reply_token_ids)) if given else (prompt or "")[: params.max_tokens]
        frames = len(reply)
        if speech is not None and speech.talker.max_tokens is not None:
            frames = min(frames, speech.talker.max_tokens)
        rng = np.random.default_rng(speech.talker.seed if speech is not None else 0)
        text, ids, audio = "", [], []
        for i, ch in enumerate(reply):
            await asyncio.sleep(0)
            if i == 2 and "crash" in reply:
                raise RuntimeError("internal engine error")
            failed = i == 2 and "fail" in reply
            done = failed or i == len(reply) - 1
            delta = None
            if speech is not None and i < frames and not failed:
                delta = rng.uniform(-0.5, 0.5, FRAME).astype(np.float32)
                audio.append(delta)
            if not given and not failed:
                text, ids = text + ch, [*ids, ord(ch)]
            out = CompletionOutput(0, text, ids, ("error" if failed else "length") if done else None)
            out.delta_text = "" if given or failed else ch
            yield RequestOutput(
                request_id,
                prompt,
                prompt_token_ids,
                [out],
                finished=done,
                error="pretend" if failed else None,
                audio_delta=delta,
                num_audio_frames=len(audio),
                audio=np.concatenate(audio) if done and speech is not None else None,
            )
            if done:
                return

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        self.ready = False


@pytest.fixture
def engine() -> SpeakingPipeline:
    return SpeakingPipeline()


@pytest.fixture
def http(engine) -> TestClient:
    return TestClient(build_app(engine, MODEL))


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def noise(seed: int | None, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.uniform(-0.5, 0.5, FRAME).astype(np.float32) for _ in range(frames)])


def pcm16(audio: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(audio * 32768.0), -32768, 32767).astype(np.int16)


def read_wav(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == AUDIO_SAMPLE_RATE and samples.ndim == 1
    return samples


def decoded(data: bytes) -> np.ndarray:
    """An encoded answer's samples as FFmpeg decodes them, at 24 kHz (Opus decodes at 48 kHz)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_SAMPLE_RATE)
    with av.open(io.BytesIO(data)) as container:
        frames = [out for frame in container.decode(audio=0) for out in resampler.resample(frame)]
    return np.concatenate([f.to_ndarray().reshape(-1) for f in [*frames, *resampler.resample(None)]])


def decoded_seconds(data: bytes) -> float:
    return len(decoded(data)) / AUDIO_SAMPLE_RATE


def sse_events(body: str) -> list:
    return [
        json.loads(line[6:])
        for line in body.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def assert_400(response, param: str | None, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"], error
    assert error["param"] == param, error


# -- chat ---------------------------------------------------------------------------------------------


def test_chat_with_audio_answers_message_audio(client, engine):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        seed=11,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
    )
    message = reply.choices[0].message
    assert message.content is None
    assert message.audio.transcript == "Say he" and message.audio.id.startswith("audio-")
    np.testing.assert_array_equal(read_wav(base64.b64decode(message.audio.data)), pcm16(noise(11, 6)))
    assert reply.usage.completion_tokens == 12  # 6 text tokens and 6 codec frames, as OpenAI counts them
    assert reply.usage.completion_tokens_details.audio_tokens == 6
    assert reply.usage.completion_tokens_details.text_tokens == 6
    _, params, speech = engine.calls[-1]
    assert params.max_tokens == 6 and params.seed == 11
    assert speech.voice == "chelsie" and speech.reply_token_ids is None
    assert (speech.talker.seed, speech.talker.temperature, speech.talker.top_k) == (11, 0.9, 50)


def test_chat_audio_takes_the_talker_controls(client, engine):
    audio = {"voice": {"id": "aiden"}, "format": "flac", "max_frames": 3, "temperature": 0.5, "top_k": 7}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"modalities": ["audio"], "audio": audio}
    )
    samples = read_wav(base64.b64decode(reply.choices[0].message.audio.data))
    assert len(samples) == 3 * FRAME  # the text went on; the audio stopped at max_frames
    assert reply.choices[0].message.audio.transcript == "Say hell"
    talker = engine.calls[-1][2].talker
    assert (talker.max_tokens, talker.temperature, talker.top_k, talker.repetition_penalty) == (
        3,
        0.5,
        7,
        1.05,
    )


@pytest.mark.parametrize("name", ["mp3", "opus", "aac", "pcm16"])
def test_chat_audio_in_each_format(http, name):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "seed": 1} | SPOKEN
    r = http.post("/v1/chat/completions", json=body | {"audio": {"voice": "ethan", "format": name}})
    data = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    if name == "pcm16":
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), pcm16(noise(1, 5)))
    else:
        assert abs(decoded_seconds(data) - 5 * FRAME / AUDIO_SAMPLE_RATE) < FRAME / AUDIO_SAMPLE_RATE


@pytest.mark.parametrize("name", ["mp3", "opus", "aac"])
def test_a_streamed_chat_reply_sends_its_encoded_audio_as_it_is_spoken(client, name):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello there"}], "max_tokens": 12}
    stream = client.chat.completions.create(
        **kwargs, seed=5, modalities=["text", "audio"], audio={"voice": "ethan", "format": name}, stream=True
    )
    audio = [c.choices[0].delta.audio for c in stream if c.choices and c.choices[0].delta.audio]
    data = [base64.b64decode(a.data) for a in audio if a.data]
    assert len(data) >= 10  # bytes with (nearly) every one of the 12 frames, not one file at the end
    whole = client.chat.completions.create(
        **kwargs, seed=5, modalities=["text", "audio"], audio={"voice": "ethan", "format": name}
    )
    # the same encoding, streamed or whole (an Ogg stream's serial number is drawn afresh for each)
    streamed = decoded(b"".join(data))
    np.testing.assert_array_equal(streamed, decoded(base64.b64decode(whole.choices[0].message.audio.data)))
    assert abs(len(streamed) / AUDIO_SAMPLE_RATE - 12 * FRAME / AUDIO_SAMPLE_RATE) < FRAME / AUDIO_SAMPLE_RATE


def test_streamed_audio_deltas_equal_the_whole_reply(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=7, seed=5, modalities=["text", "audio"])
    whole = client.chat.completions.create(**kwargs, audio={"voice": "ethan", "format": "pcm16"})
    chunks = list(
        client.chat.completions.create(
            **kwargs,
            audio={"voice": "ethan", "format": "pcm16"},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    audio = [
        c.choices[0].delta.audio.model_dump(exclude_none=True)
        for c in chunks
        if c.choices and c.choices[0].delta.audio
    ]
    assert audio[0]["id"] and all("id" not in a for a in audio[1:])
    streamed = b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a)
    assert streamed == base64.b64decode(whole.choices[0].message.audio.data)
    assert "".join(a.get("transcript", "") for a in audio) == whole.choices[0].message.audio.transcript
    assert audio[-1] == {"expires_at": audio[-1]["expires_at"]}
    assert all(c.choices[0].delta.content is None for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens_details.audio_tokens == 7


def test_a_text_chat_is_unchanged(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Say"}
    assert r.json()["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    }


CHAT_REFUSALS = [
    (
        {"audio": {"voice": "bogus", "format": "wav"}},
        "audio.voice",
        "unknown voice 'bogus'; this model speaks with aiden, chelsie, ethan",
    ),
    (
        {"audio": {"voice": "ethan", "format": "m4a"}},
        "audio.format",
        "'m4a' is not supported; this server encodes wav, flac, mp3, opus, aac, pcm16",
    ),
    ({"audio": None}, "audio", "is required when modalities has 'audio'"),
    ({"modalities": ["text"]}, "modalities", "must include 'audio'"),
    ({"stream": True}, "audio.format", "a streamed reply's audio is mp3, opus, aac, pcm16"),
    (
        {"audio": {"voice": "ethan", "format": "wav", "max_frames": 0}},
        "audio.max_frames",
        "greater than or equal to 1",
    ),
    (
        {"audio": {"voice": "ethan", "format": "wav", "temperature": -1}},
        "audio.temperature",
        "temperature must be >= 0",
    ),
    ({"audio": {"voice": "ethan", "format": "wav", "top_p": 0}}, "audio.top_p", "top_p must be in (0, 1]"),
    (
        {"audio": {"voice": "ethan", "format": "wav", "repetition_penalty": 0}},
        "audio.repetition_penalty",
        "repetition_penalty must be > 0",
    ),
    (
        {"audio": {"voice": "ethan", "format": "wav", "max_frames": 3, "min_frames": 5}},
        "audio.min_frames",
        "min_frames (5) must not exceed max_frames (3)",
    ),
    (
        {"audio": {"voice": "ethan", "format": "wav", "max_frames": 4097}},
        "audio.max_frames",
        "or equal to 4096",
    ),
    (
        {"audio": {"voice": "ethan", "format": "wav", "max_frames": 2_000_000}},
        "audio.max_frames",
        "or equal to 4096",
    ),
    (
        {"audio": {"voice": "ethan", "format": "wav", "min_frames": 4097}},
        "audio.min_frames",
        "or equal to 4096",
    ),
    ({"audio": {"voice": {"name": "ethan"}, "format": "wav"}}, "audio.voice.id", "Field required"),
    ({"audio": {"voice": 5, "format": "wav"}}, "audio.voice", "a voice's name or an object naming it"),
    ({"add_generation_prompt": False}, "add_generation_prompt", "must be true for a spoken reply"),
    ({"audio": {"voice": "ethan", "format": "wav", "top_k": 2**64}}, "audio.top_k", "less than or equal to"),
    ({"audio": {"voice": "ethan", "format": "wav", "seed": 1}}, "audio.seed", "unknown field"),
]


@pytest.mark.parametrize(("fields", "param", "needle"), CHAT_REFUSALS)
def test_bad_chat_audio_is_400(http, engine, fields, param, needle):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3} | SPOKEN | fields
    assert_400(
        http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None}),
        param,
        needle,
    )
    assert engine.calls == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "ethan", "format": "wav"}}, "audio"),
    ],
)
def test_audio_from_a_checkpoint_without_a_talker_is_400(fields, param):
    http = TestClient(build_app(SpeakingPipeline(voices=()), MODEL))
    body = {"model": MODEL, "messages": MESSAGES} | fields
    assert_400(http.post("/v1/chat/completions", json=body), param, "it has no talker, so it cannot speak")
    speech = {"model": MODEL, "input": "Hi", "voice": "ethan"}
    assert_400(http.post("/v1/audio/speech", json=speech), "voice", "it has no talker, so it cannot speak")


def test_a_failure_mid_stream_is_an_error_event(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a fail"}], "stream": True} | SPOKEN
    body["audio"] = {"voice": "ethan", "format": "pcm16"}
    r = http.post("/v1/chat/completions", json=body)
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "engine_error" and r.text.endswith("data: [DONE]\n\n")
    assert sum("data" in (e["choices"][0]["delta"].get("audio") or {}) for e in events[:-1]) == 2


# -- /v1/audio/speech ---------------------------------------------------------------------------------


def test_speech_returns_a_playable_wav_of_exactly_the_input(client, engine):
    result = client.audio.speech.create(
        model=MODEL, input="Hello!", voice="ethan", response_format="wav", extra_body={"seed": 3}
    )
    assert result.response.headers["content-type"] == "audio/wav"
    np.testing.assert_array_equal(read_wav(result.content), pcm16(noise(3, 6)))
    prompt_ids, params, speech = engine.calls[-1]
    assert prompt_ids == [1, 2, *map(ord, "Hello!")] and speech.reply_token_ids == [*map(ord, "Hello!")]
    assert speech.voice == "ethan" and speech.talker.seed == 3 and params.max_tokens == 6


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("mp3", "audio/mpeg"),
        ("opus", "audio/ogg"),
        ("aac", "audio/aac"),
        ("flac", "audio/flac"),
        ("pcm", "audio/pcm"),
    ],
)
def test_speech_in_each_format(http, name, content_type):
    body = {"model": MODEL, "input": "Hello!", "voice": "aiden", "response_format": name, "seed": 2}
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == content_type
    if name == "pcm":
        np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), pcm16(noise(2, 6)))
    else:
        assert abs(decoded_seconds(r.content) - 6 * FRAME / AUDIO_SAMPLE_RATE) < FRAME / AUDIO_SAMPLE_RATE


def test_speech_defaults_to_mp3(http):
    r = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "ethan"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"


def test_speech_streams_raw_pcm_as_it_is_decoded(http):
    body = {"model": MODEL, "input": "Hello!", "voice": "ethan", "response_format": "pcm", "seed": 4}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        pieces = list(r.iter_raw())
    assert len(pieces) == 6  # one chunk per decoded frame
    np.testing.assert_array_equal(np.frombuffer(b"".join(pieces), "<i2"), pcm16(noise(4, 6)))


@pytest.mark.parametrize("name", ["pcm", "wav"])
def test_speech_sse_events(http, name):
    body = {
        "model": MODEL,
        "input": "Hello!",
        "voice": "ethan",
        "response_format": name,
        "stream_format": "sse",
    }
    r = http.post("/v1/audio/speech", json=body | {"seed": 9})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *deltas, done = sse_events(r.text)
    assert "[DONE]" not in r.text  # OpenAI's speech stream ends with its done event
    assert {d["type"] for d in deltas} == {"speech.audio.delta"} and len(deltas) == (
        6 if name == "pcm" else 1
    )
    data = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    samples = np.frombuffer(data, "<i2") if name == "pcm" else read_wav(data)
    np.testing.assert_array_equal(samples, pcm16(noise(9, 6)))
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 8, "output_tokens": 6, "total_tokens": 14},
    }


@pytest.mark.parametrize("name", ["mp3", "opus", "aac"])
@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_speech_streams_lossy_formats_as_they_are_encoded(http, name, stream_format):
    body = {"model": MODEL, "input": "Hello there, you", "voice": "ethan", "response_format": name}
    with http.stream("POST", "/v1/audio/speech", json=body | {"stream_format": stream_format}) as r:
        pieces = list(r.iter_raw())
    if stream_format == "sse":
        *deltas, done = sse_events(b"".join(pieces).decode())
        assert done["type"] == "speech.audio.done"
        pieces = [base64.b64decode(d["audio"]) for d in deltas]
    else:
        assert (
            r.headers["content-type"] == {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}[name]
        )
    assert len(pieces) >= 14  # 16 frames: a piece with (nearly) each, not the file once at the end
    assert abs(decoded_seconds(b"".join(pieces)) - 16 * FRAME / AUDIO_SAMPLE_RATE) < FRAME / AUDIO_SAMPLE_RATE


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speech_speed_stretches_the_audio(http, speed):
    body = {
        "model": MODEL,
        "input": "Hello there, you",
        "voice": "ethan",
        "response_format": "pcm",
        "seed": 3,
    }
    plain = http.post("/v1/audio/speech", json=body).content
    stretched = http.post("/v1/audio/speech", json=body | {"speed": speed}).content
    assert len(stretched) == pytest.approx(len(plain) / speed, rel=0.05)


def test_speech_accepts_instructions_and_does_not_apply_them(http):
    body = {"model": MODEL, "input": "Hello!", "voice": "ethan", "response_format": "pcm", "seed": 4}
    plain = http.post("/v1/audio/speech", json=body)
    instructed = http.post("/v1/audio/speech", json=body | {"instructions": "Speak softly."})
    assert instructed.status_code == 200 and instructed.content == plain.content


def test_speech_failure_mid_stream(http):
    body = {
        "model": MODEL,
        "input": "a fail",
        "voice": "ethan",
        "response_format": "pcm",
        "stream_format": "sse",
    }
    events = sse_events(http.post("/v1/audio/speech", json=body).text)
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.delta", "error"]
    assert events[-1]["error"]["code"] == "engine_error"
    # Raw audio cannot carry an error: the app raises, so the server cuts the connection and the client sees
    # a broken body rather than a short one that ends cleanly.
    with pytest.raises(AudioCut, match="internal engine error"):
        http.post("/v1/audio/speech", json=body | {"input": "a crash", "stream_format": "audio"})


SPEECH_REFUSALS = [
    ({"voice": "bogus"}, "voice", "unknown voice 'bogus'; this model speaks with aiden, chelsie, ethan"),
    ({"voice": {"id": "nobody"}}, "voice", "unknown voice 'nobody'"),
    (
        {"response_format": "m4a"},
        "response_format",
        "'m4a' is not supported; this server encodes mp3, opus, aac, flac, wav, pcm",
    ),
    ({"speed": 0.2}, "speed", "greater than or equal to 0.25"),
    ({"speed": 4.01}, "speed", "less than or equal to 4"),
    ({"speed": "fast"}, "speed", "valid number"),
    ({"input": ""}, "input", "at least 1 character"),
    ({"input": "x" * 4097}, "input", "at most 4096 characters"),
    ({"input": "\ud800"}, "input", "not valid Unicode"),
    ({"stream_format": "chunks"}, "stream_format", "'audio' or 'sse'"),
    ({"max_frames": 0}, "max_frames", "greater than or equal to 1"),
    ({"seed": 2**63}, "seed", "less than or equal to"),
    ({"temperature": float("inf")}, "temperature", "finite number"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"max_frames": 3, "min_frames": 9}, "min_frames", "min_frames (9) must not exceed max_frames (3)"),
    ({"max_frames": 4097}, "max_frames", "less than or equal to 4096"),
    ({"max_frames": 100_000}, "max_frames", "less than or equal to 4096"),
    ({"max_frames": 2_000_000}, "max_frames", "less than or equal to 4096"),
    ({"min_frames": 4097}, "min_frames", "less than or equal to 4096"),
    ({"voice": {"name": "ethan"}}, "voice.id", "Field required"),
    ({"voice": {"id": 5}}, "voice.id", "valid string"),
    ({"voice": 5}, "voice", "a voice's name or an object naming it"),
    ({"voice": None}, "voice", "a voice's name or an object naming it"),
    ({"model": "tts-1"}, None, "the model 'tts-1' does not exist"),
]


@pytest.mark.parametrize(("fields", "param", "needle"), SPEECH_REFUSALS)
def test_bad_speech_is_refused(http, engine, fields, param, needle):
    body = {"model": MODEL, "input": "Hi", "voice": "ethan"} | fields
    r = http.post("/v1/audio/speech", content=json.dumps(body), headers={"content-type": "application/json"})
    if fields.get("model"):
        assert r.status_code == 404 and needle in r.text
    else:
        assert_400(r, param, needle)
    assert engine.calls == []


def test_speech_is_counted_in_the_metrics(http):
    http.post(
        "/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "ethan", "response_format": "wav"}
    )
    http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "nobody"})
    metrics = http.get("/metrics").text
    assert 'omnistage_requests_total{endpoint="/v1/audio/speech",status="200"} 1.0' in metrics
    assert 'omnistage_requests_total{endpoint="/v1/audio/speech",status="400"} 1.0' in metrics


# -- live: `omnistage serve` of the tiny checkpoint (random weights: the speech is noise) --------------

SPEECH_WAV = Path(__file__).parents[1] / "data" / "speech_en.wav"
FRAMES = 6  # at most; random weights never say EOS, so every request is capped (max_frames) to stay short


@pytest.fixture(scope="module")
def live(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def live_client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live_model() -> str:
    return SHARED_MODEL


def live_chat(
    client: openai.OpenAI,
    model: str,
    audio_format: str,
    content: str | list = "Hi",
    voice: str = "ethan",
    **kwargs,
):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        seed=7,
        modalities=["text", "audio"],
        extra_body={"audio": {"voice": voice, "format": audio_format, "max_frames": FRAMES}},
        **kwargs,
    )


def test_live_speech_create_is_a_playable_wav(live_client, live_model):
    result = live_client.audio.speech.create(
        model=live_model,
        input="Hello there.",
        voice="chelsie",
        response_format="wav",
        extra_body={"max_frames": FRAMES, "seed": 1},
    )
    assert result.response.headers["content-type"] == "audio/wav"
    samples, rate = soundfile.read(io.BytesIO(result.content), dtype="float32")
    assert rate == AUDIO_SAMPLE_RATE and samples.ndim == 1  # mono
    assert 0 < len(samples) <= FRAMES * FRAME and np.abs(samples).max() > 0


def test_live_speech_streams_what_it_answers_whole(live_client, live, live_model):
    extras = {"max_frames": FRAMES, "seed": 2}
    body = {"model": live_model, "input": "Hello there.", "voice": "aiden"} | extras
    whole = httpx.post(f"{live.url}/v1/audio/speech", json=body | {"response_format": "wav"}, timeout=120)
    with live_client.audio.speech.with_streaming_response.create(
        model=live_model, input="Hello there.", voice="aiden", response_format="pcm", extra_body=extras
    ) as raw:
        assert raw.headers["content-type"] == "audio/pcm"
        streamed = b"".join(raw.iter_bytes())
    sse = httpx.post(
        f"{live.url}/v1/audio/speech",
        json=body | {"response_format": "pcm", "stream_format": "sse"},
        timeout=120,
    )
    *deltas, done = sse_events(sse.text)
    assert b"".join(base64.b64decode(d["audio"]) for d in deltas) == streamed
    np.testing.assert_array_equal(np.frombuffer(streamed, "<i2"), read_wav(whole.content))
    assert 0 < done["usage"]["output_tokens"] <= FRAMES


def test_live_chat_with_modalities_answers_audio(live_client, live_model):
    reply = live_chat(live_client, live_model, "wav")
    message = reply.choices[0].message
    samples = read_wav(base64.b64decode(message.audio.data))
    assert len(samples) > 0 and message.audio.transcript and message.content is None
    assert 0 < reply.usage.completion_tokens_details.audio_tokens <= FRAMES


def test_live_streamed_audio_equals_the_whole_for_the_same_seed(live_client, live_model):
    reply = live_chat(live_client, live_model, "pcm16")
    whole = reply.choices[0].message.audio
    chunks = list(
        live_chat(live_client, live_model, "pcm16", stream=True, stream_options={"include_usage": True})
    )
    audio = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert b"".join(base64.b64decode(a.data) for a in audio if a.data) == base64.b64decode(whole.data)
    assert "".join(a.transcript or "" for a in audio) == whole.transcript
    assert chunks[-1].usage == reply.usage


def test_live_audio_in_and_audio_out(live_client, live_model):
    clip = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(SPEECH_WAV.read_bytes()).decode(), "format": "wav"},
    }
    reply = live_chat(
        live_client, live_model, "flac", content=[clip, {"type": "text", "text": "Answer aloud."}]
    )
    decoded, rate = soundfile.read(io.BytesIO(base64.b64decode(reply.choices[0].message.audio.data)))
    assert rate == AUDIO_SAMPLE_RATE and len(decoded) > 0
    assert reply.usage.prompt_tokens > 30  # the clip's placeholders


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"voice": "bogus"}, "unknown voice 'bogus'; this model speaks with aiden, chelsie, ethan"),
        (
            {"response_format": "m4a"},
            "'m4a' is not supported; this server encodes mp3, opus, aac, flac, wav, pcm",
        ),
        ({"speed": 5.0}, "speed: Input should be less than or equal to 4"),
        ({"input": "x" * 4097}, "at most 4096 characters"),
        ({"extra_body": {"max_frames": 100_000}}, "max_frames: Input should be less than or equal to 4096"),
        ({"extra_body": {"max_frames": 2_000_000}}, "max_frames: Input should be less than or equal to 4096"),
    ],
)
def test_live_bad_speech_is_400(live_client, live_model, kwargs, needle):
    request = {"model": live_model, "input": "Hi", "voice": "ethan"} | kwargs
    with pytest.raises(openai.BadRequestError, match=needle):
        live_client.audio.speech.create(**request)


def test_live_bad_chat_audio_is_400(live_client, live_model):
    with pytest.raises(openai.BadRequestError, match="unknown voice 'bogus'"):
        live_chat(live_client, live_model, "wav", voice="bogus")
    with pytest.raises(openai.BadRequestError, match="a streamed reply's audio is mp3, opus, aac, pcm16"):
        live_chat(live_client, live_model, "wav", stream=True)


def test_live_speaking_leaves_every_page_free(live_client, live, live_model):
    live_chat(live_client, live_model, "pcm16")
    live.wait_pages_free(timeout=10)
    assert 'omnistage_requests_total{endpoint="/v1/audio/speech",status="200"}' in live.metrics_text()


def test_live_forced_frames_speak_exactly_that_many(live_client, live_model, tiny_checkpoint):
    """min_frames with ignore_eos: the codec's end is never drawn, so random weights speak every frame asked."""
    from omnistage.models.qwen3_omni.code2wav import lookahead_samples
    from omnistage.models.qwen3_omni.config import Qwen3OmniConfig

    lookahead = lookahead_samples(Qwen3OmniConfig.from_dir(tiny_checkpoint).code2wav)
    extras = {"max_frames": 9, "min_frames": 9, "ignore_eos": True, "seed": 3}
    result = live_client.audio.speech.create(
        model=live_model, input="Hello there.", voice="ethan", response_format="wav", extra_body=extras
    )
    samples, _ = soundfile.read(io.BytesIO(result.content), dtype="float32")
    assert len(samples) == 9 * FRAME - lookahead
