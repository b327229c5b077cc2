"""What the realtime benchmark sends and what it reports, apart from the sockets: the user's utterances
(unique to each session and turn), their microphone-sized chunks on the audio timeline, and the table of
latencies.

Every session's every turn carries its own faint dither, so that no two turns are the same bytes: the prefix
cache and the audio tower's cache may then serve a session only its own earlier turns, never another
session's identical clip (which would make a turn's first audio a cache hit no real user gets).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
import soundfile
import soxr

from omnistage.bench.clips import dithered
from omnistage.bench.stats import percentile
from omnistage.bench.turn_clips import audible_span

RATE = 24_000  # the Realtime API's pcm16 rate
GAP_S = 0.2  # between repeats of the recording: shorter than server VAD's silence, so one utterance


def utterance(speech: np.ndarray, speech_rate: int, seconds: float, lead_s: float = 0.0) -> np.ndarray:
    """`seconds` of speech at RATE: the recording's audible span again and again, GAP_S apart, cut at
    `seconds`, after `lead_s` of silence."""
    start, end = audible_span(speech, speech_rate)
    spoken = soxr.resample(np.asarray(speech[start:end], np.float32), speech_rate, RATE)
    gap = np.zeros(int(GAP_S * RATE), np.float32)
    repeats = int(np.ceil(seconds * RATE / (len(spoken) + len(gap))))
    voiced = np.concatenate([np.concatenate([spoken, gap]) for _ in range(repeats)])[: int(seconds * RATE)]
    return np.concatenate([np.zeros(int(lead_s * RATE), np.float32), voiced]).astype(np.float32)


def pcm16(audio: np.ndarray, seed: int) -> bytes:
    """`audio` as pcm16 with the dither of `seed` (a session's and turn's own number)."""
    return (np.clip(dithered(audio, seed), -1, 1) * 32767).astype("<i2").tobytes()


def chunks(pcm: bytes, chunk_ms: int) -> list[bytes]:
    """The microphone's chunks of `chunk_ms` (the last one shorter)."""
    step = RATE * chunk_ms // 1000 * 2
    return [pcm[at : at + step] for at in range(0, len(pcm), step)]


def send_times(count: int, chunk_ms: int, pace: float) -> list[float]:
    """When each chunk goes, in seconds from the stream's start: a microphone sends a chunk once it has
    recorded it (chunk k at (k+1) chunks' time), `pace` times faster than real time (0: all at once). The
    audio at time a of the stream was then spoken at a / pace."""
    if pace <= 0:
        return [0.0] * count
    return [(k + 1) * chunk_ms / 1000 / pace for k in range(count)]


def wav(pcm: bytes) -> bytes:
    """pcm16 at RATE as a WAV file, as a chat request carries audio."""
    out = io.BytesIO()
    soundfile.write(out, np.frombuffer(pcm, "<i2"), RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


@dataclass(frozen=True)
class Turn:
    """One measured turn: `latency_s` from the end of speech (the commit sent, or speech_stopped received) to
    the first audio packet; what its reply came to."""

    concurrency: int
    turn: int  # 1-based, within its session
    latency_s: float
    text_tokens: int
    audio_s: float
    status: str


FINISHED = ("completed", "incomplete")  # incomplete: the reply reached max_output_tokens


# What /metrics says of a part (each sample's sum over its labels): the server's own end of speech to first
# audio delta sent, and what the caches served (realtime turns should hit, the chat baseline should not).
SERVER_SAMPLES = (
    "omnistage_realtime_first_audio_seconds_sum",
    "omnistage_realtime_first_audio_seconds_count",
    "omnistage_prefix_cache_queries_total",
    "omnistage_prefix_cache_hits_total",
    "omnistage_encoder_cache_hits_total",
    "omnistage_talker_prefix_cache_hits_total",
)


PHASES = "omnistage_realtime_phase_seconds"  # per phase label: where the server's first audio time went
_PHASE = re.compile(rf'^{PHASES}_(sum|count)\{{phase="(\w+)"\}} (\S+)$')


def scraped(text: str) -> dict[str, float]:
    """SERVER_SAMPLES' values in a /metrics page, and each realtime phase's sum and count (`sum:PHASE`)."""
    values = dict.fromkeys(SERVER_SAMPLES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
        elif phase := _PHASE.match(line):
            values[f"{phase[1]}:{phase[2]}"] = float(phase[3])
    return values


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server counted between two scrapes: its mean first audio and each of its phases' means (ms),
    and the caches' hits."""
    change = {name: after[name] - before.get(name, 0.0) for name in after}
    count = change["omnistage_realtime_first_audio_seconds_count"]
    mean = change["omnistage_realtime_first_audio_seconds_sum"] / count * 1e3 if count else float("nan")
    phases = {
        f"{name.split(':', 1)[1]}_mean_ms": round(change[name] / turns * 1e3, 1)
        for name in change
        if name.startswith("sum:") and (turns := change["count:" + name.split(":", 1)[1]])
    }
    return {
        "first_audio_mean_ms": round(mean, 1),
        "first_audio_count": count,
        "prefix_tokens_queried": change["omnistage_prefix_cache_queries_total"],
        "prefix_tokens_hit": change["omnistage_prefix_cache_hits_total"],
        "encoder_cache_hits": change["omnistage_encoder_cache_hits_total"],
        "talker_rows_hit": change["omnistage_talker_prefix_cache_hits_total"],
        **phases,
    }


def latency_rows(turns: list[Turn], label: str, show: tuple[int, ...]) -> list[str]:
    """The table's rows: per concurrency and per turn in `show`, the median, p90 and max of the latency (ms)
    over the sessions, and the replies' median length."""
    rows = []
    for c in sorted({t.concurrency for t in turns}):
        for number in show:
            mine = [t for t in turns if t.concurrency == c and t.turn == number]
            if not mine:
                continue
            ms = [t.latency_s * 1e3 for t in mine]
            text = percentile([float(t.text_tokens) for t in mine], 50)
            audio = percentile([t.audio_s for t in mine], 50)
            done = sum(t.status in FINISHED for t in mine)
            rows.append(
                f"| {label} | {c} | {number} | {len(mine)} | {percentile(ms, 50):.1f} | "
                f"{percentile(ms, 90):.1f} | {max(ms):.1f} | {text:.0f} | {audio:.2f} | {done}/{len(mine)} |"
            )
    return rows


HEADER = (
    "| measure | sessions | turn | n | median ms | p90 ms | max ms | text tokens | audio s | finished |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


@dataclass(frozen=True)
class Cut:
    """One barge-in (perf_counter times): the user's speech begins on the audio timeline (`onset`), server VAD's
    speech_started arrives (`started`), the cut reply's last audio delta arrives (`last_audio`), then its
    response.done (`done`)."""

    onset: float
    started: float
    last_audio: float
    done: float


def barge_in_rows(cuts: list[Cut]) -> list[str]:
    """How long the reply's audio went on after the user began to speak (0 where its last packet had come
    before), and when its cancelled response.done came; from speech_started as the client received it, and
    from the speech's start on the audio timeline (which adds the detector's delay and a chunk's time)."""
    measures = {
        "barge-in: speech_started → last audio": [max(0.0, c.last_audio - c.started) for c in cuts],
        "barge-in: speech_started → response.done": [c.done - c.started for c in cuts],
        "barge-in: speech onset → last audio": [max(0.0, c.last_audio - c.onset) for c in cuts],
        "barge-in: speech onset → response.done": [c.done - c.onset for c in cuts],
    }
    rows = []
    for name, values in measures.items():
        if not values:
            rows.append(f"| {name} | 1 | - | 0 | - | - | - | - | - | - |")
            continue
        ms = [v * 1e3 for v in values]
        rows.append(
            f"| {name} | 1 | - | {len(ms)} | {percentile(ms, 50):.1f} | {percentile(ms, 90):.1f} | "
            f"{max(ms):.1f} | - | - | - |"
        )
    return rows
