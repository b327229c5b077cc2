"""The spoken answers kept for later turns: bounded by age and by count."""

from __future__ import annotations

from omnistage.server.spoken_answers import SpokenAnswers


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_answer_is_kept_until_it_expires():
    clock = Clock()
    answers = SpokenAnswers(retention_s=10, max_answers=5, clock=clock)
    assert answers.keep("a", "Hello") == 110
    clock.now = 109.9
    assert answers.transcript("a") == "Hello"
    clock.now = 110
    assert answers.transcript("a") is None and len(answers) == 0
    assert answers.transcript("never") is None


def test_the_oldest_answers_go_beyond_the_count():
    answers = SpokenAnswers(retention_s=60, max_answers=2, clock=Clock())
    for name in "abc":
        answers.keep(name, name.upper())
    assert [answers.transcript(name) for name in "abc"] == [None, "B", "C"]


def test_no_retention_keeps_nothing():
    clock = Clock()
    for answers in (SpokenAnswers(0, 10, clock), SpokenAnswers(60, 0, clock)):
        answers.keep("a", "Hi")
        assert answers.transcript("a") is None and len(answers) == 0
