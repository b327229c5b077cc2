"""Live `omnistage serve` processes on free ports, and a fake AsyncPipeline for in-process app tests."""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from omnistage.bench.constrained import thinking_checkpoint
from omnistage.bench.server_process import ServerProcess
from omnistage.bench.videos import encode, frames
from omnistage.config import engine_config
from omnistage.errors import InvalidMedia, QueueFull
from omnistage.models.qwen3_omni.transcription import (
    TRANSLATION_INSTRUCTION,
    max_transcription_tokens,
    transcription_messages,
)
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.async_pipeline import AsyncPipeline, Preparing
from omnistage.pipeline.base import Frontend
from omnistage.request import GenerationRequest, SamplingParams

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"


@pytest.fixture
def replies_run_to_their_cap(monkeypatch):
    """The tiny random Thinker, sampled unseeded at temperature 1, ends a realtime reply at its first token in ~1
    run of 20 (seen in CI); tests about the conversation and its events use this so every reply runs to its cap."""
    from omnistage.server.realtime import turns

    monkeypatch.setattr(turns, "SamplingParams", functools.partial(SamplingParams, ignore_eos=True))


class LiveServer(ServerProcess):
    """One `omnistage serve` subprocess, with the /metrics readings the tests check."""

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, by name."""
        text = self.metrics_text()
        return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+) ([0-9.e+-]+)$", text, re.MULTILINE)}

    def wait_pages_free(self, timeout: float) -> float:
        """Seconds until every KV page is free again (raises if not within `timeout`)."""
        start = time.monotonic()
        while True:
            m = self.metrics()
            if (
                m["omnistage_kv_pages_used"] == 0
                and m["omnistage_kv_pages_free"] == m["omnistage_kv_pages_total"]
            ):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"KV pages still used after {timeout} s: {m['omnistage_kv_pages_used']}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory, tiny_checkpoint):
    """A context manager starting `omnistage serve --model <tiny> --device cpu ARGS` and waiting for /health
    (with `ready=False` it yields the server as soon as its process runs: its caller waits later)."""

    @contextmanager
    def launch(name: str, *args: str, ready: bool = True) -> Iterator[LiveServer]:
        log = tmp_path_factory.mktemp(name) / "server.log"
        common = ["--model", str(tiny_checkpoint), "--device", "cpu", "--log-level", "warning"]
        server = LiveServer([*common, *args], log)
        try:
            yield server.wait_ready() if ready else server
        finally:
            server.stop()

    return launch


# The name the shared servers serve the tiny checkpoint under.
SHARED_MODEL = "tiny"


@pytest.fixture(scope="session", autouse=True)
def start_shared_servers(request) -> None:
    """Start the shared servers the session's tests use as the session begins: each start takes seconds of a
    CPU, spent while the tests before their first user run on the other core."""
    used = {name for item in request.session.items for name in item.fixturenames}
    for name in ("shared_server", "shared_media_server"):
        if name in used:
            request.getfixturevalue(f"{name}_process")


@pytest.fixture(scope="session")
def shared_server_process(launch_server) -> Iterator[LiveServer]:
    """One server for the modules that need no flag of their own (each start costs seconds on 2 cores): 64 pages,
    a context of 1,024 tokens, 3 stored responses. Its prefix cache, counters and stored responses hold what
    earlier modules left: a test that uses it may not expect them fresh (read counters as differences)."""
    with launch_server(
        "shared-server", "--served-model-name", SHARED_MODEL, "--num-kv-pages", "64",
        "--max-model-len", "1024", "--max-stored-responses", "3", ready=False,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="session")
def shared_server(shared_server_process) -> LiveServer:
    return shared_server_process.wait_ready()


@pytest.fixture(scope="session")
def shared_media_dir(tmp_path_factory) -> Path:
    """The media directory of `shared_media_server`: the recorded utterance and three short videos."""
    root = tmp_path_factory.mktemp("shared-media")
    shutil.copy(SPEECH, root / "speech.wav")
    (root / "clip.mp4").write_bytes(encode(frames(20, 64, 48), fps=10, kind="mp4"))  # 2 s with a tone
    (root / "long.mkv").write_bytes(encode(frames(40, 64, 48), fps=10, kind="mkv", tone_hz=None))  # 4 s
    (root / "silent.webm").write_bytes(encode(frames(20, 64, 48), fps=10, kind="webm", tone_hz=None))
    return root


@pytest.fixture(scope="session")
def shared_media_server_process(launch_server, shared_media_dir) -> Iterator[LiveServer]:
    """One `--media-dir` server (256 pages: a video's prompt is long) for the media and video modules."""
    with launch_server(
        "shared-media-server", "--served-model-name", SHARED_MODEL, "--num-kv-pages", "256",
        "--media-dir", str(shared_media_dir), ready=False,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="session")
def shared_media_server(shared_media_server_process) -> LiveServer:
    return shared_media_server_process.wait_ready()


@pytest.fixture(scope="session")
def thinking_template_checkpoint(tiny_thinking_checkpoint, tmp_path_factory) -> Path:
    """The tiny Thinking checkpoint (its files linked) with a template that opens the think block for the reply,
    or closes it empty when the request's chat_template_kwargs turn thinking off; `note` renders a template
    variable as it is given."""
    directory = thinking_checkpoint(tmp_path_factory.mktemp("thinking-template"), tiny_thinking_checkpoint)
    template = directory / "chat_template.jinja"
    template.write_text(template.read_text() + "{{- note | default('') }}")
    return directory


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    """The served name: the checkpoint directory's name by default."""
    return tiny_checkpoint.name


@pytest.fixture(scope="module")
def client(server):
    """The openai client of the module's `server` (a module may define its own, e.g. with an API key)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_checkpoint) -> Iterator[AsyncPipeline]:
    """The real engine over the tiny checkpoint on the CPU (64 pages: a context of 1,024 tokens), for in-process apps."""
    engine = AsyncPipeline.from_config(
        engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=64)
    )
    try:
        yield engine
    finally:
        engine.shutdown()


# -- a fake AsyncPipeline with the real one's interface, for failures a real model cannot be made to show ----


@dataclass
class FakeProcessedPrompt:
    prompt: str
    token_ids: list[int]
    mrope: object | None
    mm: object | None
    max_tokens: int | None = None


class FakeProcessor:
    """Text as it is; decoded media as markers in the prompt (`<audio 2.98s>`, `<image 64x32>`).

    Text content "boom" raises an exception the server does not expect.
    """

    max_attachments = 3
    renders_tools = True  # the tools are not in its prompt: the echo carries the messages alone

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        prompt = "\n".join(m["content"] if isinstance(m["content"], str) else "" for m in messages)
        if "boom" in prompt:
            raise RuntimeError("secret internals")
        return prompt, self.encode(prompt)

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        return [ord(c) for c in text]

    def transcription(
        self, audio: np.ndarray, language: str | None, prompt: str | None, max_model_len: int | None = None
    ) -> FakeProcessedPrompt:
        laid_out = self.process_chat(transcription_messages(audio, language, prompt), True, max_model_len)
        return replace(laid_out, max_tokens=max_transcription_tokens(len(audio) / 16000))

    def translation(
        self, audio: np.ndarray, prompt: str | None, max_model_len: int | None = None
    ) -> FakeProcessedPrompt:
        messages = transcription_messages(audio, None, prompt, TRANSLATION_INSTRUCTION)
        laid_out = self.process_chat(messages, True, max_model_len)
        return replace(laid_out, max_tokens=max_transcription_tokens(len(audio) / 16000))

    def transcript(self, text: str) -> tuple[str | None, str]:
        return None, text

    def process_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_model_len: int | None = None,
        use_audio_in_video: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> FakeProcessedPrompt:
        lines, media = [], []
        for message in messages:
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            line = ""
            for part in parts:
                if part["type"] == "text":
                    line += part["text"]
                elif part["type"] == "audio":
                    audio = part["audio"]
                    assert audio.dtype == np.float32 and audio.ndim == 1
                    line += f"<audio {len(audio) / 16000:.2f}s>"
                    media.append(audio)
                elif part["type"] == "image":
                    line += f"<image {part['image'].width}x{part['image'].height}>"
                    media.append(part["image"])
                else:
                    raise AssertionError(f"the processor got an undecoded part: {part['type']}")
            lines.append(line)
        if len(media) > self.max_attachments:
            raise InvalidMedia(
                f"too many attachments: {len(media)}, the model takes at most {self.max_attachments}"
            )
        prompt = "\n".join(lines)
        return FakeProcessedPrompt(prompt, self.encode(prompt), "mrope" if media else None, media or None)


def refuse_to_speak(text: str) -> object:
    raise AssertionError("a checkpoint without a talker is never asked to speak")


class FakePipeline:
    """Echoes its prompt back one character per step; the prompt's text picks a failure to act out.

    "queue-full": QueueFull before the first output; "explode": an exception before the first output;
    "fail": a finish_reason "error" output after two tokens; "crash": an exception after two tokens.
    """

    def __init__(self) -> None:
        # a checkpoint without a talker, and without a memory plan (a CPU engine has none)
        self.frontend = Frontend(Path("/models/fake"), 4096, FakeProcessor(), refuse_to_speak)
        self.ready = True
        self.running: set[str] = set()
        self.closed: list[str] = []
        self.last_media: tuple[object | None, object | None] = (None, None)
        self.in_preparation = 0  # the server's count of requests being prepared (`preparing`)
        self.coming_at_generate: list[int] = []  # that count when each request was handed over

    def preparing(self) -> Preparing:
        self.in_preparation += 1
        return Preparing(self)

    def _prepared(self) -> None:
        self.in_preparation -= 1

    def stats(self) -> dict[str, int]:
        used = 2 * len(self.running)
        return {
            "num_waiting": 0,
            "num_running": len(self.running),
            "kv_pages_total": 16,
            "kv_pages_free": 16 - used,
            "kv_pages_used": used,
        }

    async def generate(
        self, request: GenerationRequest, preparing: Preparing | None = None
    ) -> AsyncIterator[RequestOutput]:
        if preparing is not None:
            preparing.done()
        request_id, prompt, prompt_token_ids = request.request_id, request.prompt, request.prompt_token_ids
        params = request.params
        self.last_media = (request.mrope, request.mm)
        self.coming_at_generate.append(self.in_preparation)
        text = prompt or ""
        if "queue-full" in text:
            raise QueueFull("the server's queue is full (1 requests waiting, the limit is 1)")
        if "explode" in text:
            raise RuntimeError("CUDA out of memory (pretend)")
        self.running.add(request_id)
        try:
            out = CompletionOutput(index=0, text="", token_ids=[])
            reply = text[: params.max_tokens]
            for i, ch in enumerate(reply):
                await asyncio.sleep(0.001)
                if i == 2 and "crash" in text:
                    raise RuntimeError("internal engine error")
                failed = i == 2 and "fail" in text
                done = failed or i == len(reply) - 1
                out = CompletionOutput(
                    index=0,
                    text=out.text + ("" if failed else ch),
                    token_ids=[*out.token_ids, ord(ch)],
                    finish_reason=("error" if failed else "length") if done else None,
                    delta_text="" if failed else ch,
                    delta_token_ids=[ord(ch)],
                )
                yield RequestOutput(
                    request_id,
                    prompt,
                    prompt_token_ids,
                    [out],
                    finished=done,
                    error="OutOfMemoryError: pretend" if failed else None,
                    # delivered: when this output reached its consumer, as AsyncPipeline stamps it
                    metrics={
                        "arrival": 0.0,
                        "first_token": 0.01,
                        "finished": 0.02,
                        "delivered": time.monotonic(),
                    },
                )
                if done:
                    return
        finally:
            self.running.discard(request_id)
            self.closed.append(request_id)

    def abort(self, request_id: str) -> None:
        self.running.discard(request_id)

    def shutdown(self) -> None:
        self.ready = False


@pytest.fixture
def fake_pipeline() -> FakePipeline:
    return FakePipeline()


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a thread of this process; yields its base URL (http://127.0.0.1:PORT)."""
    import threading

    import uvicorn

    from omnistage.cli.serve import bind

    listener = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
