"""The playground's Voice tab in headless Chromium against a live `omnistage serve` (tiny checkpoint, CPU):
Chromium's fake microphone plays a recorded utterance between silences, over and over, into a realtime session.

The server runs without `--api-key`: a browser cannot put the key in a WebSocket's Authorization header.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import soundfile

from omnistage.bench.server_process import ServerProcess
from omnistage.bench.turn_clips import turn_clip
from tests.browser.conftest import CHROMIUM

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
TIMEOUT_MS = 90_000
# The fake microphone loops its file: the utterance's first 1.3 s at 0.4 s, then 4 s of silence, in which
# the turn ends (500 ms of silence) and its answer streams until the utterance comes round again over it
# (32 tokens: several seconds of speech, longer than the silence left, however fast the answer comes).
SILENCES_MS = (400, 4000)
SPOKEN_S = 1.3


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("voice-server") / "server.log"
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--num-kv-pages", "256"]
    server = ServerProcess(args, log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """The fake microphone's WAV: 48 kHz pcm16, the rate a capture device runs at."""
    speech, rate = soundfile.read(SPEECH, dtype="float32")
    clip = turn_clip(speech[: int(SPOKEN_S * rate)], rate, 48_000, SILENCES_MS, (1.0,))
    path = tmp_path_factory.mktemp("voice-mic") / "turn.wav"
    soundfile.write(path, clip.audio, clip.sample_rate, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def speaking_browser(microphone) -> Iterator[object]:
    """Chromium whose microphone is `microphone`, granted without asking."""
    playwright = pytest.importorskip("playwright.sync_api", reason="the `test` extra installs playwright")
    args = [
        "--no-sandbox",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}",
    ]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("playground-shots")


def voice(page) -> dict:
    return page.evaluate("window.playground.voice.state()")


def test_a_spoken_turn_is_answered_aloud_and_speaking_again_interrupts_it(speaking_browser, server, shots):
    context = speaking_browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
        sent: list[dict] = []
        received: list[dict] = []

        def watch(socket) -> None:
            socket.on("framesent", lambda frame: sent.append(json.loads(frame)))
            socket.on("framereceived", lambda frame: received.append(json.loads(frame)))

        page.on("websocket", watch)
        page.goto(server.url)
        page.wait_for_selector("body[data-ready=true]", state="attached")
        page.click("#tab-voice")
        page.select_option("#voice-voice", "ethan")
        page.fill("#voice-max-tokens", "32")
        page.focus("#voice-mic")
        page.keyboard.press("Enter")  # the button by keyboard
        page.wait_for_selector("#voice-mic[aria-pressed=true]", state="attached")

        # the first turn: heard, answered, its audio played and its transcript shown, its latency beside it
        page.wait_for_selector("#voice-log li.assistant[data-latency-ms]")
        page.wait_for_function(
            "window.playground.voice.state().turns.some(t => t.role === 'assistant' && t.state !== 'streaming')"
        )
        page.wait_for_function("window.playground.voice.state().truncations >= 1")
        page.screenshot(path=shots / "voice.png", full_page=True)
        page.click("#voice-mic")  # stop: the socket closed, nothing more is sent
        page.wait_for_selector("#voice-status[data-state=stopped]", state="attached")
        state = voice(page)
    finally:
        context.close()

    update = next(e for e in sent if e["type"] == "session.update")["session"]
    assert update["audio"]["output"]["voice"] == "ethan" and update["max_output_tokens"] == 32
    assert update["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    appended = [e for e in sent if e["type"] == "input_audio_buffer.append"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in appended)
    assert len(pcm) == state["sentBytes"] and len(pcm) % 2 == 0
    assert len(pcm) / 2 / 24_000 > sum(SILENCES_MS) / 1000  # at 24 kHz: the loop came round
    kinds = [e["type"] for e in received]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped")

    # what the server sent of the first answer is what the page received, played and shows
    first = next(e["response"]["id"] for e in received if e["type"] == "response.created")
    audio = [
        base64.b64decode(e["delta"])
        for e in received
        if e["type"] == "response.output_audio.delta" and e["response_id"] == first
    ]
    transcript = "".join(
        e["delta"]
        for e in received
        if e["type"] == "response.output_audio_transcript.delta" and e["response_id"] == first
    )
    answers = [t for t in state["turns"] if t["role"] == "assistant"]
    assert audio and transcript and answers[0]["text"] == transcript
    assert answers[0]["latencyMs"] > 0
    everything = [
        base64.b64decode(e["delta"]) for e in received if e["type"] == "response.output_audio.delta"
    ]
    assert state["receivedBytes"] == state["player"]["receivedBytes"] == sum(map(len, everything))
    assert state["player"]["context"] == "running" and state["player"]["pieces"] >= 1

    # speaking again: the answer under way was cut where the page had played it, and the server agreed
    (truncate, *_) = [e for e in sent if e["type"] == "conversation.item.truncate"]
    cut = next(t for t in answers if t["state"] == "interrupted")
    assert truncate["item_id"] == cut["itemId"] and truncate["content_index"] == 0
    assert 0 < truncate["audio_end_ms"] <= cut["audioMs"]
    truncated = next(e for e in received if e["type"] == "conversation.item.truncated")
    assert (
        truncated["audio_end_ms"] == truncate["audio_end_ms"]
        and cut["truncatedMs"] == truncate["audio_end_ms"]
    )
    (at, done) = next(
        (i, e["response"])
        for i, e in enumerate(received)
        if e["type"] == "response.done"
        and e["response"]["output"]
        and e["response"]["output"][0]["id"] == cut["itemId"]
    )
    created = next(
        i
        for i, e in enumerate(received)
        if e["type"] == "response.created" and e["response"]["id"] == done["id"]
    )
    barged = [i for i, e in enumerate(received[created:at], created) if e["type"].endswith("speech_started")]
    if barged:  # the user spoke while the server still made it: cancelled at once
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    else:  # all made (to max_output_tokens) before the user spoke; the page was still playing it
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
    assert [e for e in received if e["type"] == "error"] == []
    assert errors == []


def test_a_refused_session_is_said_plainly(speaking_browser, server):
    context = speaking_browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url)
        page.wait_for_selector("body[data-ready=true]", state="attached")
        # a model this server does not serve: the real route refuses the handshake (404)
        page.evaluate("window.playground.model = 'no-such-model'")
        page.click("#tab-voice")
        page.click("#voice-mic")
        page.wait_for_selector("#voice-status[data-state=refused]", state="attached")
        assert page.inner_text("#voice-status").startswith(
            "No realtime session could be opened at /v1/realtime"
        )
        assert page.get_attribute("#voice-mic", "aria-pressed") == "false" and page.is_enabled("#voice-mic")
        assert voice(page)["open"] is False
    finally:
        context.close()
