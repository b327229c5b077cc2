"""The realtime bench's arithmetic: the utterances it sends, their chunks on the audio timeline, and its table."""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import soundfile

from omnistage.bench import realtime_turns as rt
from omnistage.bench.realtime import SPEECH, Bench, parse
from omnistage.bench.realtime_socket import Reply
from omnistage.bench.turn_clips import audible_span


def recording() -> tuple[np.ndarray, int]:
    speech, rate = soundfile.read(SPEECH, dtype="float32")
    return speech, rate


def test_utterance_is_speech_for_its_length_after_its_lead():
    speech, rate = recording()
    audio = rt.utterance(speech, rate, 10.0, lead_s=0.5)
    assert len(audio) == int(10.5 * rt.RATE)
    start, end = audible_span(audio, rt.RATE)
    assert abs(start / rt.RATE - 0.5) < 0.02  # the speech starts where the lead ends
    assert end / rt.RATE > 9.5  # and repeats to the end: no silence long enough to end a VAD turn
    window = rt.RATE // 100
    rms = np.sqrt(
        np.mean(audio[start:end][: (end - start) // window * window].reshape(-1, window) ** 2, axis=1)
    )
    quiet_run = max(len(run) for run in "".join("q" if r < 1e-3 else "s" for r in rms).split("s"))
    assert quiet_run * 10 < 500  # ms: under server VAD's silence_duration_ms


def test_each_seed_is_other_bytes_of_the_same_sound():
    speech, rate = recording()
    audio = rt.utterance(speech, rate, 2.0)
    one, again, other = rt.pcm16(audio, 1), rt.pcm16(audio, 1), rt.pcm16(audio, 2)
    assert one == again and one != other
    a, b = (np.frombuffer(x, "<i2").astype(np.float64) for x in (one, other))
    assert 5 < np.sqrt(np.mean((a - b) ** 2)) < 20  # pcm16 steps apart (two ditherings): the same speech
    assert np.corrcoef(a, b)[0, 1] > 0.999


def test_chunks_and_their_times_follow_the_microphone():
    pcm = bytes(2 * rt.RATE)  # 1 s
    pieces = rt.chunks(pcm, 100)
    assert [len(p) for p in pieces] == [4800] * 10
    assert b"".join(rt.chunks(pcm[:-10], 30)) == pcm[:-10]
    assert np.allclose(rt.send_times(3, 100, 1.0), [0.1, 0.2, 0.3])  # each once recorded
    assert np.allclose(rt.send_times(3, 100, 2.0), [0.05, 0.1, 0.15])
    assert rt.send_times(3, 100, 0.0) == [0.0, 0.0, 0.0]


def test_wav_holds_the_samples():
    pcm = np.arange(-500, 500, dtype="<i2").tobytes()
    samples, rate = soundfile.read(io.BytesIO(rt.wav(pcm)), dtype="int16")
    assert rate == rt.RATE and samples.tobytes() == pcm


def test_latency_rows_per_concurrency_and_turn():
    turns = [rt.Turn(8, n, 0.1 * s + 0.01 * n, 8, 6.5, "incomplete") for s in range(1, 9) for n in (1, 2, 5)]
    turns[0] = rt.Turn(8, 1, 0.1, 8, 6.5, "cancelled")
    rows = rt.latency_rows(turns, "m", (1, 5))
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[:4] == ["m", "8", "5", "8"]
    assert float(cells[4]) == 500.0  # the median of 150, 250, ..., 850 ms
    assert float(cells[6]) == 850.0
    assert cells[-1] == "8/8"
    assert rows[0].endswith("| 7/8 |")


def test_barge_in_rows_count_no_audio_after_the_speech_as_zero():
    cuts = [rt.Cut(onset=10.0, started=10.1, last_audio=9.9, done=10.12), rt.Cut(20.0, 20.1, 20.13, 20.15)]
    rows = {row.split("|")[1].strip(): row for row in rt.barge_in_rows(cuts)}
    started_last = [c.strip() for c in rows["barge-in: speech_started → last audio"].strip("|").split("|")]
    assert float(started_last[6]) == 30.0  # the max: 30 ms of audio after speech_started; the other 0
    assert float(started_last[4]) == 15.0
    onset_done = [c.strip() for c in rows["barge-in: speech onset → response.done"].strip("|").split("|")]
    assert float(onset_done[4]) == 135.0
    assert rt.barge_in_rows([])[0].split("|")[4].strip() == "0"


def test_command_line_defaults_are_the_h200_run():
    args = parse(["--out-dir", "x"])
    assert (
        args.concurrency == [1, 8, 32] and args.turns == 5 and args.utterance_s == 10.0 and args.pace == 1.0
    )
    assert args.listen and args.think_s == 1.0
    assert not parse(["--out-dir", "x", "--no-listen"]).listen


def test_the_user_hears_a_reply_out_then_pauses():
    bench = Bench(parse(["--out-dir", "x"]), "http://unused")
    reply = Reply(first_audio=time.perf_counter(), audio_bytes=2 * rt.RATE // 5)  # 0.2 s of audio

    async def listened() -> float:
        start = time.perf_counter()
        await bench.listen(reply, 0.1)
        return time.perf_counter() - start

    assert 0.29 <= asyncio.run(listened()) < 0.45


def test_the_servers_view_is_the_change_between_two_scrapes():
    page = """# HELP omnistage_realtime_first_audio_seconds End of speech to the first audio delta
omnistage_realtime_first_audio_seconds_bucket{le="0.1"} 1.0
omnistage_realtime_first_audio_seconds_sum 0.25
omnistage_realtime_first_audio_seconds_count 2.0
omnistage_prefix_cache_queries_total 300.0
omnistage_prefix_cache_hits_total{stage="thinker"} 100.0
omnistage_prefix_cache_hits_total{stage="talker"} 20.0
omnistage_prefix_cache_hits_created 1.7e9
omnistage_talker_prefix_cache_hits_total 40.0
"""
    before = rt.scraped(page)
    assert before["omnistage_prefix_cache_hits_total"] == 120.0
    assert before["omnistage_encoder_cache_hits_total"] == 0.0
    after = rt.scraped(page.replace("_sum 0.25", "_sum 0.55").replace("_count 2.0", "_count 4.0"))
    view = rt.server_view(before, after)
    assert view["first_audio_mean_ms"] == 150.0 and view["first_audio_count"] == 2.0
    assert view["prefix_tokens_hit"] == 0.0
    assert before["omnistage_talker_prefix_cache_hits_total"] == 40.0
    changed = rt.server_view(before, rt.scraped(page.replace("hits_total 40.0", "hits_total 75.0")))
    assert changed["talker_rows_hit"] == 35.0
    assert np.isnan(rt.server_view(before, before)["first_audio_mean_ms"])


def test_the_servers_view_has_each_phases_mean():
    page = """omnistage_realtime_first_audio_seconds_sum 0.3
omnistage_realtime_first_audio_seconds_count 2.0
omnistage_realtime_phase_seconds_bucket{le="0.1",phase="prefill"} 2.0
omnistage_realtime_phase_seconds_sum{phase="prefill"} 0.1
omnistage_realtime_phase_seconds_count{phase="prefill"} 2.0
omnistage_realtime_phase_seconds_sum{phase="speak"} 0.2
omnistage_realtime_phase_seconds_count{phase="speak"} 2.0
"""
    before = rt.scraped(page)
    after = rt.scraped(
        page.replace('sum{phase="prefill"} 0.1', 'sum{phase="prefill"} 0.4')
        .replace('count{phase="prefill"} 2.0', 'count{phase="prefill"} 5.0')
        .replace('sum{phase="speak"} 0.2', 'sum{phase="speak"} 0.5')
        .replace('count{phase="speak"} 2.0', 'count{phase="speak"} 5.0')
    )
    view = rt.server_view(before, after)
    assert view["prefill_mean_ms"] == 100.0 and view["speak_mean_ms"] == 100.0
    assert "speak_mean_ms" not in rt.server_view(before, before)  # no turn in between: no mean
