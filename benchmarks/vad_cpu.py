"""Server VAD's two candidates on the CPU: silero-vad (ONNX) and webrtcvad, through the same turn tracker.

Accuracy: on speech-silence-speech clips (tests/data/speech_en.wav placed in silence at two gains, at 16 and
24 kHz) each detector's speech_started (plus the prefix padding: the detected start) and speech_stopped
(less the silence duration: the detected end) against the audible span; false starts on 20 s of each noise
and of silence, at each rate. Cost: CPU time per second of audio, one thread, the
least of five runs. Prints a markdown table.

    python benchmarks/vad_cpu.py
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import soundfile
import soxr
import webrtcvad

from omnistage.bench.turn_clips import noise_clip, turn_clip
from omnistage.server.vad import MODEL_RATE, SpeechDetector, TurnTracker, VadEvent, VadSettings

SPEECH = Path(__file__).parents[1] / "tests" / "data" / "speech_en.wav"
SETTINGS = VadSettings()
WEBRTC_FRAME_MS = 30


class WebrtcDetector:
    """webrtcvad's yes/no per 30 ms frame as a probability of 0 or 1, into the same tracker."""

    def __init__(self, mode: int, sample_rate: int) -> None:
        self.vad = webrtcvad.Vad(mode)
        self.sample_rate = sample_rate
        self.tracker = TurnTracker(SETTINGS, WEBRTC_FRAME_MS)

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        audio = pcm if self.sample_rate == MODEL_RATE else soxr.resample(pcm, self.sample_rate, MODEL_RATE)
        pcm16 = (np.clip(audio, -1, 1) * 32767).astype("<i2")
        step = MODEL_RATE * WEBRTC_FRAME_MS // 1000
        events = []
        for start in range(0, len(pcm16) - step + 1, step):
            speech = self.vad.is_speech(pcm16[start : start + step].tobytes(), MODEL_RATE)
            event = self.tracker.step(1.0 if speech else 0.0)
            if event is not None:
                events.append(event)
        return events


def detectors(sample_rate: int) -> dict[str, object]:
    return {
        "silero-vad 6 (ONNX)": SpeechDetector(SETTINGS, sample_rate),
        **{f"webrtcvad mode {mode}": WebrtcDetector(mode, sample_rate) for mode in (1, 3)},
    }


def cpu_ms_per_second(name: str, audio: np.ndarray, rate: int) -> float:
    """The least of five runs on a fresh detector: the machine is shared, the least is the detector's own."""
    runs = []
    for _ in range(5):
        detector = detectors(rate)[name]
        started = time.thread_time()
        detector.feed(audio)  # type: ignore[attr-defined]
        runs.append(time.thread_time() - started)
    return min(runs) / (len(audio) / rate) * 1000


def main() -> None:
    speech, speech_rate = soundfile.read(SPEECH, dtype="float32")
    rows: dict[str, dict[str, list[float]]] = {}
    for rate in (16000, 24000):
        clip = turn_clip(speech, speech_rate, rate)
        for name, detector in detectors(rate).items():
            row = rows.setdefault(name, {"start": [], "end": [], "missed": [], "cost": []})
            events = detector.feed(clip.audio)  # type: ignore[attr-defined]
            row["cost"].append(cpu_ms_per_second(name, clip.audio, rate))
            starts = [e.audio_ms + SETTINGS.prefix_padding_ms for e in events if e.kind == "speech_started"]
            ends = [e.audio_ms - SETTINGS.silence_duration_ms for e in events if e.kind == "speech_stopped"]
            row["missed"].append(abs(len(starts) - len(clip.turns)) + abs(len(ends) - len(clip.turns)))
            for (start, end), got_start, got_end in zip(clip.turns, starts, ends, strict=False):
                row["start"].append(got_start - start)
                row["end"].append(got_end - end)
        for kind in ("silence", "white", "hum", "clicks"):
            audio = np.zeros(20 * rate, np.float32) if kind == "silence" else noise_clip(kind, 20, rate)
            for name, detector in detectors(rate).items():
                events = detector.feed(audio)  # type: ignore[attr-defined]
                rows[name][kind] = rows[name].get(kind, []) + [
                    sum(e.kind == "speech_started" for e in events)
                ]
    noises = ("silence", "white", "hum", "clicks")
    print(
        "| detector | start error (ms) | end error (ms) | turns missed or split "
        f"| false starts in 40 s of {', '.join(noises)} | CPU ms per s of audio, 16 / 24 kHz |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(
            f"| {name} | {min(row['start']):+.0f} .. {max(row['start']):+.0f} "
            f"| {min(row['end']):+.0f} .. {max(row['end']):+.0f} | {sum(row['missed']):.0f} "
            f"| {' / '.join(str(sum(row[kind])) for kind in noises)} "
            f"| {row['cost'][0]:.2f} / {row['cost'][1]:.2f} |"
        )


if __name__ == "__main__":
    main()
