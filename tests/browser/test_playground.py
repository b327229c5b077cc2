"""The playground page in headless Chromium against a live `omnistage serve` (tiny checkpoint, CPU, an API key).

Each state the page reaches is saved as a screenshot under the module's tmp dir (`playground-shots`).
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from omnistage.bench.server_process import ServerProcess
from omnistage.bench.videos import encode, frames
from omnistage.engine.memory.gauges import Gauge
from omnistage.pipeline.base import Frontend
from omnistage.server.metrics import ServerMetrics

API_KEY = "sk-playground"
SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
TIMEOUT_MS = 60_000
GiB = 2**30


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("playground-server") / "server.log"
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--api-key", API_KEY, "--num-kv-pages", "256"]
    server = ServerProcess(args, log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("playground-shots")


class Page:
    """A fresh browser context on the playground, with the console's errors and the page's exceptions."""

    def __init__(
        self,
        browser,
        server: ServerProcess,
        key: str | None,
        metrics: Callable[[], str] | None,
        **context,
    ) -> None:
        self.context = browser.new_context(**context)
        if metrics is not None:  # /metrics answered with these texts instead of the server's
            self.context.route(
                "**/metrics", lambda route: route.fulfill(content_type="text/plain", body=metrics())
            )
        if key is not None:  # the key a person gave earlier in this tab
            self.context.add_init_script(f"sessionStorage.setItem('omnistage-api-key', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        self.url = server.url

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"{message.text} at {message.location}")

    def open(self, path: str = "/") -> Page:
        self.page.goto(f"{self.url}{path}")
        return self

    def ready(self) -> Page:
        self.page.wait_for_selector("body[data-ready=true]", state="attached")
        return self

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser, server) -> Iterator:
    pages: list[Page] = []

    def open_(
        path: str = "/", key: str | None = API_KEY, metrics: Callable[[], str] | None = None, **context
    ) -> Page:
        pages.append(Page(browser, server, key, metrics, **context).open(path))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


def player(page) -> dict:
    return page.evaluate("window.playground.player.state()")


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_page_loads_without_console_errors(open_page, server, tiny_checkpoint, shots):
    for path in ("/", "/playground"):
        p = open_page(path).ready()
        page = p.page
        assert page.inner_text("#model-name") == tiny_checkpoint.name
        assert page.is_hidden("#key-form")
        assert p.errors == []
    page.screenshot(path=shots / "loaded.png", full_page=True)
    # the startup log names the page
    assert f"the playground: {server.url}/" in server.log.read_text()


def test_narrow_and_dark(open_page, shots):
    p = open_page(viewport={"width": 380, "height": 760}, color_scheme="dark").ready()
    page = p.page
    assert page.evaluate("document.documentElement.scrollWidth") <= 380  # nothing runs off a phone's screen
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(21, 22, 26)", background
    # by keyboard: the arrows move between the tabs
    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")
    assert page.get_attribute("#tab-voice", "aria-selected") == "true"
    assert page.is_visible("#panel-voice") and page.is_hidden("#panel-chat")
    page.screenshot(path=shots / "narrow-dark.png", full_page=True)
    assert p.errors == []


def test_typed_chat_streams_its_answer(open_page, shots):
    p = open_page().ready()
    page = p.page
    page.fill("#chat-max-tokens", "48")
    page.fill("#chat-input", "Hello there")
    page.press("#chat-input", "Enter")  # Enter sends
    # seen mid-stream: some text in, the answer still streaming
    page.wait_for_selector("#chat-log li.assistant.streaming .text:not(:empty)")
    page.wait_for_function("window.playground.chat.history.length === 2")
    history = page.evaluate("window.playground.chat.history")
    assert history[0] == {"role": "user", "content": "Hello there"}
    answer = history[1]["content"]
    assert answer and page.inner_text("#chat-log li.assistant .text") == answer
    # the next turn carries the history
    with page.expect_request("**/v1/chat/completions") as sent:
        page.fill("#chat-max-tokens", "4")
        page.fill("#chat-input", "And again")
        page.click("#chat-send")
    assert sent.value.post_data_json["messages"][:2] == history
    page.wait_for_function("window.playground.chat.history.length === 4")
    page.screenshot(path=shots / "chat.png", full_page=True)
    assert p.errors == []


def prompt_tokens(server: ServerProcess, model: str, messages: list[dict]) -> int:
    body = {"model": model, "messages": messages, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    return reply.json()["usage"]["prompt_tokens"]


def test_image_and_audio_attachments_are_sent_and_answered(open_page, server, tiny_checkpoint, shots):
    p = open_page().ready()
    page = p.page
    png = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(png, "PNG")
    page.set_input_files("#chat-file", {"name": "red.png", "mimeType": "image/png", "buffer": png.getvalue()})
    page.wait_for_selector("#attachments li:has-text('red.png')")
    page.set_input_files("#chat-file", str(SPEECH))
    page.wait_for_selector("#attachments li:has-text('speech_en.wav')")
    page.fill("#chat-max-tokens", "6")
    page.fill("#chat-input", "What is in the picture?")
    with page.expect_response("**/v1/chat/completions") as answered:
        page.click("#chat-send")
    assert answered.value.status == 200
    page.wait_for_function("window.playground.chat.history.length === 2")
    parts = answered.value.request.post_data_json["messages"][0]["content"]
    assert parts[0]["type"] == "image_url"
    assert (
        parts[0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    )
    clip = parts[1]["audio_url"]["url"]
    assert clip.startswith("data:audio/") and base64.b64decode(clip.split(",", 1)[1]) == SPEECH.read_bytes()
    assert parts[2] == {"type": "text", "text": "What is in the picture?"}
    usage = [e["usage"] for e in sse_data(answered.value.text()) if e.get("usage")]
    text_alone = prompt_tokens(server, tiny_checkpoint.name, [{"role": "user", "content": parts[2:]}])
    assert usage[-1]["prompt_tokens"] > text_alone  # the picture's and the clip's tokens are in the prompt
    assert usage[-1]["prompt_tokens_details"]["audio_tokens"] > 0
    assert page.inner_text("#chat-log li.user .meta") == "image: red.png, audio: speech_en.wav"
    page.screenshot(path=shots / "image.png", full_page=True)
    assert p.errors == []


def test_a_video_with_its_sound(open_page, server, tiny_checkpoint):
    p = open_page().ready()
    page = p.page
    clip = encode(frames(20, 64, 48), fps=10, kind="mp4")  # 2 s with a tone
    page.set_input_files("#chat-file", {"name": "clip.mp4", "mimeType": "video/mp4", "buffer": clip})
    page.wait_for_selector("#attachments li:has-text('clip.mp4')")
    page.check("#use-audio-in-video")
    page.fill("#chat-max-tokens", "4")
    page.fill("#chat-input", "What happens?")
    with page.expect_response("**/v1/chat/completions") as answered:
        page.click("#chat-send")
    page.wait_for_function("window.playground.chat.history.length === 2")
    body = answered.value.request.post_data_json
    assert body["use_audio_in_video"] is True
    part = body["messages"][0]["content"][0]
    assert part == {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip).decode()},
    }
    heard = [e["usage"] for e in sse_data(answered.value.text()) if e.get("usage")][-1]
    silent = prompt_tokens(server, tiny_checkpoint.name, body["messages"])
    assert heard["prompt_tokens"] > silent + 20  # the sound track's tokens: 2 s of audio
    assert p.errors == []


def test_the_servers_error_is_shown(open_page, shots):
    p = open_page().ready()
    page = p.page
    page.set_input_files(
        "#chat-file", {"name": "broken.png", "mimeType": "image/png", "buffer": b"not a png"}
    )
    page.wait_for_selector("#attachments li:has-text('broken.png')")
    page.fill("#chat-input", "And this?")
    with page.expect_response("**/v1/chat/completions") as answered:
        page.click("#chat-send")
    page.wait_for_selector("#chat-error:not(:empty)")
    message = answered.value.json()["error"]["message"]
    assert answered.value.status == 400 and message.startswith("messages[0].content[0]")
    assert page.inner_text("#chat-error") == f"400: {message}"
    assert page.evaluate("window.playground.chat.history") == []  # the failed turn is not sent again
    page.screenshot(path=shots / "error.png", full_page=True)
    # Chromium reports the 400 on the console; nothing else may be there
    assert [e for e in p.errors if "status of 400" not in e] == []


def test_spoken_answer_is_played(open_page, shots):
    p = open_page().ready()
    page = p.page
    page.select_option("#chat-modalities", "audio")
    page.select_option("#chat-voice", "chelsie")
    page.fill("#chat-max-tokens", "6")
    page.fill("#chat-input", "Say hello.")
    with page.expect_response("**/v1/chat/completions") as answered:
        page.click("#chat-send")
    page.wait_for_function("window.playground.chat.history.length === 2")
    body = answered.value.request.post_data_json
    assert body["modalities"] == ["text", "audio"] and body["audio"] == {
        "voice": "chelsie",
        "format": "pcm16",
    }
    sent = sum(
        len(base64.b64decode(e["choices"][0]["delta"]["audio"]["data"]))
        for e in sse_data(answered.value.text())
        if e["choices"] and (e["choices"][0]["delta"].get("audio") or {}).get("data")
    )
    state = player(page)
    assert sent > 0 and state["receivedBytes"] == sent
    assert state["context"] == "running" and state["pieces"] >= 1
    assert state["scheduledSeconds"] == pytest.approx(sent / 2 / 24000)
    audio_id = page.evaluate("window.playground.chat.history[1].audio.id")
    assert audio_id.startswith("audio-")
    page.screenshot(path=shots / "spoken.png", full_page=True)
    assert p.errors == []


def test_transcribe_a_dropped_wav(open_page, shots):
    p = open_page().ready()
    page = p.page
    page.click("#tab-audio")
    dropped = page.evaluate_handle(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const files = new DataTransfer();
            files.items.add(new File([bytes], "speech_en.wav", { type: "audio/wav" }));
            return files;
        }""",
        base64.b64encode(SPEECH.read_bytes()).decode(),
    )
    with page.expect_response("**/v1/audio/transcriptions") as answered:
        page.dispatch_event("#drop", "drop", {"dataTransfer": dropped})
    page.wait_for_selector("#transcript[data-done=true]", state="attached")
    done = [e for e in sse_data(answered.value.text()) if e["type"] == "transcript.text.done"]
    assert done[0]["text"] and page.inner_text("#transcript") == done[0]["text"].strip()
    assert answered.value.request.headers["content-type"].startswith("multipart/form-data")
    page.screenshot(path=shots / "transcribe.png", full_page=True)
    assert p.errors == []


def test_speak_text(open_page, shots):
    p = open_page().ready()
    page = p.page
    page.click("#tab-audio")
    voices = page.eval_on_selector_all("#speak-voice option", "options => options.map(o => o.value)")
    assert {"ethan", "chelsie", "aiden", "alloy"} <= set(voices)
    page.select_option("#speak-voice", "ethan")
    page.fill("#speak-input", "Hello there.")
    with page.expect_response("**/v1/audio/speech") as answered:
        page.click("#speak-send")
    page.wait_for_selector("#speak-status[data-done=true]", state="attached")
    assert answered.value.request.post_data_json["voice"] == "ethan"
    audio = answered.value.body()
    state = player(page)
    assert len(audio) > 0 and state["receivedBytes"] == len(audio) and state["context"] == "running"
    page.screenshot(path=shots / "speak.png", full_page=True)
    assert p.errors == []


def synthetic_metrics() -> Callable[[], str]:
    """/metrics of a one-GPU server, rendered by the server's own code: its plan's gauges, and one more
    request of 0.5 s ended at each reading."""
    plan = [
        ("total", "", 80),
        ("weights", "thinker", 60),
        ("weights", "talker", 6),
        ("kv", "thinker", 8),
        ("graphs", "thinker", 1),
        ("floor", "", 2),
        ("reserve", "", 1),
        ("free", "", 2),
    ]
    gauges = tuple(
        Gauge("omnistage_memory_plan_bytes", {"device": "cuda:0", "part": part, "stage": stage}, size * GiB)
        for part, stage, size in plan
    )
    frontend = Frontend(Path("/models/m"), 4096, None, None, plan_gauges=gauges)  # type: ignore[arg-type]
    metrics = ServerMetrics()
    metrics.set_plan(frontend)

    def reading() -> str:
        metrics.e2e.observe(0.5)
        return metrics.render({"kv_pages_total": 1000, "kv_pages_used": 250, "kv_pages_free": 750}).decode()

    return reading


def test_memory_plan_renders(open_page, shots):
    # on the CPU there is no plan
    p = open_page().ready()
    p.page.click("#tab-server")
    p.page.wait_for_selector("#memory-plan .no-plan")
    p.page.wait_for_selector("#kv-chart[data-points]", state="attached")
    p.page.screenshot(path=shots / "server-cpu.png", full_page=True)
    assert p.errors == []

    g = open_page(metrics=synthetic_metrics()).ready()
    page = g.page
    page.click("#tab-server")
    page.wait_for_selector("#memory-plan[data-devices='1']", state="attached")
    widths = page.eval_on_selector_all(
        "#memory-plan rect", "rects => rects.map(r => [r.dataset.part, Number(r.getAttribute('width'))])"
    )
    expected = {"weights": 66, "kv": 8, "graphs": 1, "floor": 2, "reserve": 1, "free": 2}
    assert [part for part, _ in widths] == list(expected)
    for part, width in widths:
        assert width == pytest.approx(1000 * expected[part] / 80), part
    assert page.inner_text("#memory-plan figcaption") == "cuda:0: 80.0 GiB (thinker, talker)"
    assert "KV pages 8.0 GiB" in page.inner_text("#memory-plan .legend")
    assert page.inner_text("#kv-now") == "250 of 1000"
    # the latency chart: the mean of the requests that ended between two readings
    page.wait_for_selector("#latency-chart[data-points='1']", state="attached")
    assert page.inner_text("#latency-now") == "500 ms, mean of the last 1"
    page.screenshot(path=shots / "server-plan.png", full_page=True)
    assert g.errors == []


def test_voice_tab_with_the_microphone_denied(open_page, shots):
    # this Chromium has no fake device and no one to answer its prompt: the microphone is refused
    p = open_page().ready()
    page = p.page
    page.click("#tab-voice")
    page.focus("#voice-mic")
    page.keyboard.press("Enter")
    page.wait_for_selector("#voice-status[data-state=denied]", state="attached")
    assert page.inner_text("#voice-status").startswith(
        ("The browser denied the microphone.", "This device has no microphone.")
    )
    assert page.get_attribute("#voice-mic", "aria-pressed") == "false" and page.is_enabled("#voice-mic")
    page.screenshot(path=shots / "voice-denied.png", full_page=True)
    assert p.errors == []


def test_api_key_prompt_and_a_wrong_key(open_page, server, shots):
    p = open_page(key=None)
    page = p.page
    page.wait_for_selector("#key-form", state="visible")
    assert page.evaluate("document.activeElement.id") == "key-input"
    page.fill("#key-input", "sk-wrong")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-error:not(:empty)")
    assert page.inner_text("#key-error") == "401: missing or invalid API key"
    page.screenshot(path=shots / "wrong-key.png", full_page=True)
    page.fill("#key-input", API_KEY)
    page.press("#key-input", "Enter")
    p.ready()
    assert page.is_hidden("#key-form")
    assert page.evaluate("sessionStorage.getItem('omnistage-api-key')") == API_KEY
    assert re.fullmatch(r"\S+", page.inner_text("#model-name"))
