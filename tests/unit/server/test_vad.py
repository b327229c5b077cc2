"""Server VAD on a recorded utterance placed in silence (two turns, the second at half the gain), at 16 kHz and
at Realtime's 24 kHz: events where the speech is, whatever the chunking; the settings honoured; noise ignored.

Tolerances: the detected start (speech_started's audio_ms plus the prefix padding) lies within one frame
(32 ms) before the audible start, for the frame grid, and three frames after it, for the grid plus the two
frames silero may take to pass 0.5 (measured: +24 to +34 ms, benchmarks/RESULTS.md). The detected end
(speech_stopped's audio_ms less the silence duration) lies within one frame before the audible end and five
after it: silero's probability decays over a few frames after the last word (measured: +42 to +84 ms).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from omnistage.bench.turn_clips import TurnClip, noise_clip, turn_clip
from omnistage.server.vad import (
    FRAME_MS,
    FRAME_SAMPLES,
    SileroFrames,
    SpeechDetector,
    TurnTracker,
    VadEvent,
    VadSettings,
)

SPEECH = Path(__file__).parents[2] / "data" / "speech_en.wav"
DEFAULTS = VadSettings()


@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(SPEECH, dtype="float32")
    return audio, rate


@pytest.fixture(scope="module", params=[16000, 24000])
def clip(request, speech) -> TurnClip:
    return turn_clip(*speech, sample_rate=request.param)


def detect(clip: TurnClip, settings: VadSettings = DEFAULTS, chunk_ms: int | None = None) -> list[VadEvent]:
    detector = SpeechDetector(settings, clip.sample_rate)
    step = len(clip.audio) if chunk_ms is None else clip.sample_rate * chunk_ms // 1000
    return [
        event for at in range(0, len(clip.audio), step) for event in detector.feed(clip.audio[at : at + step])
    ]


def test_events_mark_each_turn_within_the_tolerance(clip):
    settings = VadSettings()
    events = detect(clip, settings)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"] * len(clip.turns)
    for (start, end), started, stopped in zip(clip.turns, events[::2], events[1::2], strict=True):
        assert -FRAME_MS <= started.audio_ms + settings.prefix_padding_ms - start <= 3 * FRAME_MS
        assert -FRAME_MS <= stopped.audio_ms - settings.silence_duration_ms - end <= 5 * FRAME_MS


def test_prefix_padding_moves_the_start_back_by_itself(clip):
    unpadded = detect(clip, VadSettings(prefix_padding_ms=0))
    padded = detect(clip, VadSettings(prefix_padding_ms=300))
    assert [p.audio_ms for p in padded] == [
        u.audio_ms - 300 if u.kind == "speech_started" else u.audio_ms for u in unpadded
    ]


def test_the_same_events_however_the_audio_is_split(clip):
    whole = detect(clip)
    assert detect(clip, chunk_ms=20) == whole
    assert detect(clip, chunk_ms=100) == whole
    rng = np.random.default_rng(0)
    detector = SpeechDetector(VadSettings(), clip.sample_rate)
    cuts = np.sort(
        rng.integers(0, len(clip.audio), size=200)
    )  # empty chunks and one-sample chunks among them
    pieces = np.split(clip.audio, cuts)
    assert [event for piece in pieces for event in detector.feed(piece)] == whole


def test_a_turn_starts_at_the_first_frame_reaching_the_threshold(speech):
    clip = turn_clip(*speech, sample_rate=16000)
    frames = SileroFrames()
    probabilities = np.array(
        [
            frames.probability(clip.audio[at : at + FRAME_SAMPLES])
            for at in range(0, clip.turns[0][1] * 16, 512)
        ]
    )
    for threshold in (0.2, 0.5, 0.9):
        first = int(np.argmax(probabilities >= threshold))
        started = detect(clip, VadSettings(threshold=threshold, prefix_padding_ms=0))[0]
        assert started.audio_ms == first * FRAME_MS


def test_a_threshold_above_the_speech_probability_hears_no_turn(speech):
    clip = turn_clip(*speech, sample_rate=16000, silences_ms=(1000, 1000), gains=(0.2,))
    noisy = TurnClip(clip.audio + noise_clip("white", len(clip.audio) / 16000, 16000), 16000, clip.turns)
    frames = SileroFrames()
    highest = max(
        frames.probability(noisy.audio[at : at + 512]) for at in range(0, len(noisy.audio) - 511, 512)
    )
    assert highest < 0.999  # the noise keeps the speech from certainty
    assert detect(noisy, VadSettings(threshold=min(highest + 0.005, 1.0))) == []
    assert [e.kind for e in detect(noisy, VadSettings(threshold=highest - 0.005))][:1] == ["speech_started"]


def test_silence_duration_decides_where_a_turn_ends(speech):
    clip = turn_clip(*speech, sample_rate=16000, silences_ms=(1000, 1500, 2000))  # 1.5 s between the turns
    short = detect(clip, VadSettings(silence_duration_ms=500))
    longer = detect(clip, VadSettings(silence_duration_ms=800))
    assert [e.kind for e in longer] == [e.kind for e in short]
    for s, long in zip(short, longer, strict=True):
        moved = long.audio_ms - s.audio_ms
        assert (
            moved == 0 if s.kind == "speech_started" else abs(moved - 300) < FRAME_MS
        )  # silence ends on a frame
    # a silence longer than the gap keeps both utterances in one turn
    one_turn = detect(clip, VadSettings(silence_duration_ms=1600))
    assert [e.kind for e in one_turn] == ["speech_started", "speech_stopped"]
    assert one_turn[1].audio_ms - 1600 >= clip.turns[1][1] - FRAME_MS


@pytest.mark.parametrize("rate", [16000, 24000])
@pytest.mark.parametrize("kind", ["silence", "white", "hum", "clicks"])
def test_noise_and_silence_start_no_turn(kind, rate):
    audio = np.zeros(5 * rate, np.float32) if kind == "silence" else noise_clip(kind, 5, rate)
    assert SpeechDetector(VadSettings(), rate).feed(audio) == []


def test_reset_drops_the_turn_and_keeps_the_position(clip):
    whole = detect(clip)
    rate = clip.sample_rate
    detector = SpeechDetector(VadSettings(), rate)
    middle = (clip.turns[0][0] + 1000) * rate // 1000  # a second into the first turn
    assert [e.kind for e in detector.feed(clip.audio[:middle])] == ["speech_started"]
    detector.reset()
    after = detector.feed(clip.audio[middle:])
    # the rest of the first turn is still speech: it starts a turn at once, its prefix not before the reset
    assert after[0].kind == "speech_started"
    assert after[0].audio_ms == clip.turns[0][0] + 1000
    # the model's memory was dropped too, so a probability near the threshold may cross it a frame apart
    assert [e.kind for e in after[1:]] == [e.kind for e in whole[1:]]
    assert all(abs(a.audio_ms - w.audio_ms) <= FRAME_MS for a, w in zip(after[1:], whole[1:], strict=True))


def test_a_prefix_stops_at_the_last_reset(clip):
    rate = clip.sample_rate
    detector = SpeechDetector(VadSettings(prefix_padding_ms=300), rate)
    reset_ms = clip.turns[1][0] - 100
    detector.feed(clip.audio[: reset_ms * rate // 1000])
    detector.reset()
    started = detector.feed(clip.audio[reset_ms * rate // 1000 :])[0]
    assert started == VadEvent("speech_started", reset_ms)


def test_feed_in_thread_gives_the_same_events(clip):
    detector = SpeechDetector(VadSettings(), clip.sample_rate)
    step = clip.sample_rate // 10

    async def stream() -> list[VadEvent]:
        chunks = [
            detector.feed_in_thread(clip.audio[at : at + step]) for at in range(0, len(clip.audio), step)
        ]
        return [event for events in await asyncio.gather(*chunks) for event in events]

    assert asyncio.run(stream()) == detect(clip)


def test_audio_of_more_than_one_channel_or_in_integers_is_refused():
    with pytest.raises(ValueError, match="mono"):
        SpeechDetector(VadSettings()).feed(np.zeros((2, 320), np.float32))
    with pytest.raises(ValueError, match="float"):
        SpeechDetector(VadSettings()).feed(np.zeros(320, np.int16))


def test_probabilities_between_the_two_thresholds_neither_start_nor_end_a_silence():
    """Hysteresis: a turn starts at 0.5; silence counts below 0.35, and 0.35..0.5 keeps whatever was under way."""
    tracker = TurnTracker(
        VadSettings(threshold=0.5, prefix_padding_ms=64, silence_duration_ms=96), frame_ms=32
    )
    steps = [0.4, 0.49, 0.5, 0.4, 0.3, 0.2, 0.45, 0.1, 0.6, 0.3, 0.3, 0.3]
    events = {at: event for at, p in enumerate(steps) if (event := tracker.step(p)) is not None}
    # starts on frame 2 (its prefix two frames back); silence from frame 4 lasts 3 frames to frame 6's end,
    # although frame 6 sits between the thresholds; frame 8 starts a turn, whose silence from frame 9 ends it
    assert events == {
        2: VadEvent("speech_started", 0),
        6: VadEvent("speech_stopped", 224),
        8: VadEvent("speech_started", 192),
        11: VadEvent("speech_stopped", 384),
    }


def test_the_model_loads_without_importing_silero_vad():
    """Importing the silero_vad package sets torch's threads to one for the whole server."""
    SpeechDetector(VadSettings()).feed(np.zeros(FRAME_SAMPLES, np.float32))
    assert "silero_vad" not in sys.modules
