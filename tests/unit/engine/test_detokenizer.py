import random

import pytest
from tokenizers import Tokenizer

from omnistage.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from omnistage.models.qwen3_omni.tokenizer import build_tokenizer

MIXED = "你好，世界 🎉👍🏽 naïve café"
TEXTS = [
    MIXED,
    "Hello, world! The answer is 42.\n\nEND of story.",
    "日本語のテキストと한국어 텍스트, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 👨‍👩‍👧‍👦 families",
    "emoji run 🎉🎉🎉🔥🔥 x",
]
IM_END, THINK = 151645, 151667


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas


def test_mixed_text_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(MIXED).ids
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "no split character to test"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == MIXED
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    # The emoji's three tokens produce one delta once the last byte arrives, nothing before.
    assert deltas[3:6] == ["", "", " 🎉"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert detok.flush() == ""
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_random_unicode_round_trips(tokenizer):
    rng = random.Random(0)
    alphabet = "ab 你好世界éï🎉👍🏽🔥𝔘한\n,." + "\u0301"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text).ids
        detok = IncrementalDetokenizer(tokenizer)
        deltas = stream(detok, ids)
        assert "".join(deltas) == detok.text == text
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_incomplete_character_at_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 🎉").ids[:-1]  # drop the emoji's last byte
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids)
    assert deltas[-1].endswith(REPLACEMENT_CHAR)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_invalid_bytes_mid_text_match_decode(tokenizer):
    emoji = tokenizer.encode(" 🎉").ids
    ids = emoji[:1] + tokenizer.encode(" and more").ids + emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detok, ids)) == detok.text == tokenizer.decode(ids)


def test_stop_string_spanning_tokens(tokenizer):
    text = "Hello, world! The answer is 42.\n\nEND of story."
    ids = tokenizer.encode(text).ids
    stop = "answer is 4"
    boundaries = {len(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)}
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in boundaries), "stop string does not span tokens"
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    deltas = stream(detok, ids)
    assert detok.stopped and detok.stop_str == stop
    assert "".join(deltas) == detok.text == text[:start]
    assert detok.flush() == "" and detok.add(ids[-1]) == ""


def test_include_stop_str_in_output(tokenizer):
    text = "Hello, world! The answer is 42.\n\nEND of story."
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\nEND"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == text[: text.index("\n\nEND") + 5]


def test_stop_string_inside_one_token_cuts_mid_token(tokenizer):
    text = "a wonderful day"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["nder"])
    assert "".join(stream(detok, ids)) == detok.text == "a wo"


def test_stop_string_made_of_split_emoji(tokenizer):
    ids = tokenizer.encode(MIXED).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["🎉👍"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == MIXED[: MIXED.index("🎉👍")]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_random_stop_strings_cut_at_first_completed_match(tokenizer):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        for _ in range(20):
            start = rng.randrange(len(text))
            stop = text[start : start + rng.randint(1, 6)]
            include = rng.random() < 0.5
            detok = IncrementalDetokenizer(tokenizer, stop=[stop], include_stop_str_in_output=include)
            deltas = stream(detok, ids)
            first = text.index(stop)
            expected = text[: first + len(stop) if include else first]
            assert detok.stopped
            assert "".join(deltas) == detok.text == expected, (stop, include)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = "one two three four"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["four", "two", "zzz"])
    assert "".join(stream(detok, ids)) == "one "
    assert detok.stop_str == "two"


def test_holds_back_only_what_could_start_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    ids = tokenizer.encode("Hello world ST").ids
    deltas = [detok.add(i) for i in ids]
    # "Hello world " cannot begin "STOP" and is out at once; the trailing "ST" waits.
    assert "".join(deltas) == "Hello world "
    assert detok.text == "Hello world ST"
    assert detok.flush() == "ST" and not detok.stopped


def test_held_back_prefix_released_when_it_does_not_become_a_stop(tokenizer):
    text = "x STAR and STOP"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = ""
    for token_id in ids:
        emitted += detok.add(token_id)
        assert detok.text.startswith(emitted)
        assert "STOP" not in emitted
    assert detok.stopped and emitted == detok.text == "x STAR and "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [IM_END] + tokenizer.encode("hi 🎉").ids + [IM_END, THINK]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip and "hi 🎉" in detok.text


def test_stop_string_matches_special_token_text_only_when_kept(tokenizer):
    ids = tokenizer.encode("answer").ids + [IM_END] + tokenizer.encode(" more").ids
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, stop=["<|im_end|>"])
    assert "".join(stream(kept, ids)) == "answer" and kept.stopped
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, stop=["<|im_end|>"])
    assert "".join(stream(skipped, ids)) == "answer more" and not skipped.stopped


@pytest.mark.parametrize("skip", [True, False])
def test_whole_tokens_looked_up_give_the_windows_deltas(tokenizer, skip):
    """Random ids over the whole vocabulary (bytes that split characters, special tokens, stop strings):
    the deltas with single tokens looked up are those of decoding every token's window, and join to
    `decode`."""
    rng = random.Random(1)
    vocab = tokenizer.get_vocab_size()
    split = [i for i in tokenizer.encode(MIXED + TEXTS[2]).ids if REPLACEMENT_CHAR in tokenizer.decode([i])]
    looked_up = 0
    for trial in range(60):
        ids = [
            rng.choice(split) if rng.random() < 0.3 else rng.randrange(vocab)
            for _ in range(rng.randint(1, 30))
        ]
        ids += [IM_END, THINK] if trial % 3 == 0 else []
        stop = [tokenizer.decode(ids[3:5])[-2:]] if trial % 2 and len(ids) > 5 else []
        fast = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, stop=stop)
        slow = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, stop=stop)
        slow._pieces = None
        assert stream(fast, ids) == stream(slow, ids)
        assert fast.text == slow.text and fast.stopped == slow.stopped
        if not stop:
            assert fast.text == tokenizer.decode(ids, skip)
        looked_up += fast._pieces is not None
    assert looked_up == 60
    table = fast._pieces
    assert sum(piece is not None for piece in table.values()) > 100  # the lookups were taken, and kept


def test_a_tokenizer_whose_decoder_is_not_byte_level_decodes_windows():
    from tokenizers import decoders, models

    sentencepiece = Tokenizer(models.WordLevel({"▁a": 0, "▁b": 1, "c": 2}, unk_token="c"))
    sentencepiece.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(sentencepiece)
    assert detok._pieces is None
    deltas = stream(detok, [0, 1, 2])
    assert "".join(deltas) == sentencepiece.decode([0, 1, 2]) == "a bc"
