"""Speech out as voice agents stream it, against `omnistage serve` of the tiny checkpoint (random weights: the
speech is noise) whose Talker never ends speech before its cap (`endless_checkpoint`), so lengths are fixed by
the text.

LiveKit Agents' `openai.TTS` with its defaults asks for mp3 over SSE (`speech.audio.delta` events) in voice
`ash` and decodes the mp3 as it arrives; Pipecat's `OpenAITTSService` asks for raw pcm in voice `alloy`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import statistics
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from livekit.agents.tts.tts import AudioEmitter
from livekit.plugins import openai as livekit_openai
from pipecat.frames.frames import EndFrame, ErrorFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.tts import OpenAITTSService
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.outputs import AUDIO_SAMPLE_RATE

# ~20 tokens: the Talker's cap is 25 + 8 per token frames, ~15 s of audio, as a voice agent's long sentence
LONG = "The quick brown fox jumps over the lazy dog, again and again, all through the long summer afternoon."
SHORT = "Hello."  # ~3.3 s of audio: the runs that go to the end stay short on the CPU


@pytest.fixture(scope="module")
def endless_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint, served under its name, with the codec head's end-of-speech row zeroed: its logit is
    0 among ~3k random ones, half of them above it, never in the Talker's top 50, so every utterance runs to its
    cap. Otherwise the random Talker ends one early now and then, as the unseeded draws before it fall."""
    directory = tmp_path_factory.mktemp("endless") / tiny_checkpoint.name
    shutil.copytree(tiny_checkpoint, directory)
    weights = directory / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    eos = json.loads((directory / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    tensors["talker.codec_head.weight"][eos] = 0
    save_file(tensors, str(weights), metadata=metadata)
    return directory


@pytest.fixture(scope="module")
def server(launch_server, endless_checkpoint):
    with launch_server("voice-agents", "--model", str(endless_checkpoint), "--num-kv-pages", "64") as live:
        yield live


def livekit_tts(server, model: str, **options) -> livekit_openai.TTS:
    return livekit_openai.TTS(base_url=f"{server.url}/v1", api_key="none", model=model, **options)


async def livekit_first_bytes(server, model: str, monkeypatch, **options) -> float:
    """Seconds from `synthesize` until LiveKit's emitter is handed its first audio bytes; the stream is then
    closed, as an agent interrupted mid-sentence closes it."""
    arrived = asyncio.Event()
    push = AudioEmitter.push

    def recording_push(emitter: AudioEmitter, data: bytes) -> None:
        if data:
            arrived.set()
        push(emitter, data)

    monkeypatch.setattr(AudioEmitter, "push", recording_push)
    tts = livekit_tts(server, model, **options)
    start = time.perf_counter()
    stream = tts.synthesize(LONG)
    reading = asyncio.ensure_future(stream.collect())
    try:
        await asyncio.wait_for(arrived.wait(), 60)
        return time.perf_counter() - start
    finally:
        await stream.aclose()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await tts.aclose()
        monkeypatch.setattr(AudioEmitter, "push", push)


async def livekit_whole(server, model: str, **options) -> tuple[float, float, float]:
    """(seconds to LiveKit's first decoded frame, seconds to the end, seconds of audio) of SHORT."""
    tts = livekit_tts(server, model, **options)
    start, first, samples = time.perf_counter(), None, 0
    async with tts.synthesize(SHORT) as stream:
        async for event in stream:
            first = first or time.perf_counter() - start
            assert event.frame.sample_rate == AUDIO_SAMPLE_RATE and event.frame.num_channels == 1
            samples += event.frame.samples_per_channel
    await tts.aclose()
    assert first is not None
    return first, time.perf_counter() - start, samples / AUDIO_SAMPLE_RATE


def test_livekit_defaults_get_mp3_first_bytes_as_soon_as_pcm(server, model, monkeypatch):
    async def timings() -> tuple[list[float], list[float]]:
        mp3, pcm = [], []
        for run in range(6):  # interleaved, so a busy machine weighs on both alike; the first warms up
            for times, options in ((mp3, {}), (pcm, {"response_format": "pcm"})):
                took = await livekit_first_bytes(server, model, monkeypatch, **options)
                if run:
                    times.append(took)
                # each stream was closed mid-utterance: its request is aborted and its pages freed
                server.wait_pages_free(timeout=10)
        return mp3, pcm

    mp3, pcm = asyncio.run(timings())
    assert statistics.median(mp3) <= 1.5 * statistics.median(pcm), (mp3, pcm)


def test_livekit_defaults_decode_as_the_audio_arrives(server, model):
    # once first, so that the runs timed below find the server warm
    asyncio.run(livekit_whole(server, model, response_format="pcm"))
    runs = [asyncio.run(livekit_whole(server, model)) for _ in range(3)]
    _, _, pcm_seconds = asyncio.run(livekit_whole(server, model, response_format="pcm"))
    # decoded frames came before the utterance ended, not after it: in the best of three runs, as a busy
    # machine (CI's two cores) can stall any one of them
    assert min(first / total for first, total, _ in runs) < 0.75, runs
    seconds = runs[0][2]
    # mp3 carries no record of the encoder's priming samples: up to ~50 ms more
    assert 0 <= seconds - pcm_seconds < 0.08, (seconds, pcm_seconds)
    _, _, fast = asyncio.run(livekit_whole(server, model, speed=2.0))
    assert fast == pytest.approx(seconds / 2, rel=0.05)


class Collected(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.audio: list[TTSAudioRawFrame] = []
        self.errors: list[ErrorFrame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        await self.push_frame(frame, direction)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PipelineTask/Runner, still documented in 1.x
def test_pipecat_default_voice_gets_audio_frames(server, model):
    tts = OpenAITTSService(
        api_key="none", base_url=f"{server.url}/v1", settings=OpenAITTSService.Settings(model=model)
    )
    collected = Collected()
    task = PipelineTask(Pipeline([tts, collected]), params=PipelineParams(audio_out_sample_rate=24000))

    async def speak() -> None:
        await task.queue_frames([TTSSpeakFrame(SHORT), EndFrame()])
        await PipelineRunner(handle_sigint=False).run(task)

    asyncio.run(speak())
    assert tts._settings.voice == "alloy" and not collected.errors
    assert collected.audio and {f.sample_rate for f in collected.audio} == {AUDIO_SAMPLE_RATE}
    samples = np.frombuffer(b"".join(f.audio for f in collected.audio), "<i2")
    assert 3.0 < len(samples) / AUDIO_SAMPLE_RATE < 3.5 and np.abs(samples).max() > 0


# The raw requests these clients send, in the other formats, decoded by FFmpeg


def decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples / frame.sample_rate for frame in container.decode(audio=0))


def speech(server, body: dict) -> bytes:
    response = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    if body.get("stream_format") != "sse":
        return response.content
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    return b"".join(base64.b64decode(e["audio"]) for e in events[:-1])


RAW = {"input": SHORT, "voice": "ash", "max_frames": 20, "seed": 3}


@pytest.fixture(scope="module")
def pcm_seconds(server, model) -> dict[float, float]:
    """Seconds of the raw request's pcm answer, by speed."""
    body = RAW | {"model": model, "response_format": "pcm"}
    return {
        speed: len(speech(server, body | {"speed": speed})) / 2 / AUDIO_SAMPLE_RATE for speed in (1.0, 2.0)
    }


def test_speed_2_halves_the_pcm_answer(pcm_seconds):
    assert 1.5 < pcm_seconds[1.0] <= 1.6  # 20 frames of 80 ms, less the codec's warm-up
    assert pcm_seconds[2.0] == pytest.approx(pcm_seconds[1.0] / 2, rel=0.05)


@pytest.mark.parametrize(("name", "stream_format"), [("mp3", "sse"), ("opus", "audio"), ("aac", "sse")])
@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_each_format_lasts_as_long_as_pcm(server, model, pcm_seconds, name, stream_format, speed):
    body = RAW | {"model": model, "response_format": name, "stream_format": stream_format, "speed": speed}
    seconds = decoded_seconds(speech(server, body))
    # mp3 and ADTS carry no record of the encoder's priming samples: up to ~70 ms more
    assert 0 <= seconds - pcm_seconds[speed] < 0.08, (seconds, pcm_seconds[speed])
