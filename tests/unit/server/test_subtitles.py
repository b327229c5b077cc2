"""Transcripts as subtitle cues: split at sentences and within two lines, timed by their share of the text."""

from __future__ import annotations

from omnistage.server.subtitles import MAX_CUE_CHARS, cues, srt, vtt


def test_cues_cover_the_clip_in_order_and_keep_every_word():
    text = "First sentence here. " + " ".join(f"word{i}" for i in range(60)) + "! Last one?"
    timed = cues(text, 30.0)
    assert timed[0].start == 0.0 and timed[-1].end == 30.0
    assert all(a.end == b.start for a, b in zip(timed, timed[1:]))
    assert all(c.start < c.end and len(c.text) <= MAX_CUE_CHARS for c in timed)
    assert " ".join(c.text for c in timed) == text
    assert timed[0].text == "First sentence here." and timed[-1].text == "Last one?"
    # time follows the characters: a cue's share of the duration is its share of the text
    total = sum(len(c.text) for c in timed)
    for c in timed:
        assert abs((c.end - c.start) - 30.0 * len(c.text) / total) < 1e-9


def test_text_without_spaces_is_cut_by_characters():
    text = "今天天气很好。" + "我们" * 60 + "。"
    timed = cues(text, 10.0)
    assert timed[0].text == "今天天气很好。"
    assert "".join(c.text for c in timed) == text and all(len(c.text) <= MAX_CUE_CHARS for c in timed)


def test_srt_and_vtt_clocks():
    assert srt("One. Two.", 3725.5) == (
        "1\n00:00:00,000 --> 00:31:02,750\nOne.\n\n2\n00:31:02,750 --> 01:02:05,500\nTwo.\n\n"
    )
    assert vtt("One.", 1.0) == "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nOne.\n\n"
    assert srt("", 2.0) == "" and vtt("", 2.0) == "WEBVTT\n\n"


def test_a_cue_is_one_line_whatever_whitespace_the_transcript_has():
    assert [c.text for c in cues("Hello\nthere  you. Next\tone.", 4.0)] == ["Hello there you.", "Next one."]
