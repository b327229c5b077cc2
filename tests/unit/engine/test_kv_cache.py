import pytest

from omnistage.engine.kv_cache import PagePool
from omnistage.engine.prefix_keys import PageKeys
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.errors import InvalidRequest, RequestTooLarge


def make_seq(request_id: str = "r") -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=4, data=None)


def test_sequence_properties():
    seq = Sequence("a", [5, 6, 7], max_tokens=3, output_token_ids=[8], data=None)
    assert seq.num_prompt_tokens == 3
    assert seq.num_output_tokens == 1
    assert seq.num_tokens == 4
    assert seq.all_token_ids == [5, 6, 7, 8]
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert {s for s in SequenceStatus if s.is_finished} == {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }
    assert seq != Sequence(
        "a", [5, 6, 7], max_tokens=3, output_token_ids=[8], data=None
    )  # identity, not value


def test_token_ids_slices_prompt_and_output_as_one_list():
    seq = Sequence("a", [5, 6, 7], max_tokens=3, output_token_ids=[8, 9], data=None)
    for start in range(6):
        for end in range(start, 7):
            assert seq.token_ids(start, end) == seq.all_token_ids[start:end], (start, end)
    piece = seq.token_ids(3, 5)
    piece.append(0)  # a copy: the sequence's own lists are untouched
    assert seq.output_token_ids == [8, 9]


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (160, 10)])
def test_pages_for_rounds_up(tokens, pages):
    assert PagePool(num_pages=4, page_size=16).pages_for(tokens) == pages


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 16), (4, 0), (-1, 16)])
def test_rejects_empty_pool(num_pages, page_size):
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


def test_allocate_hands_out_lowest_ids_and_counts():
    pool = PagePool(num_pages=8, page_size=4)
    assert (pool.num_free, pool.num_used) == (8, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_used) == (3, 5)
    pool.free([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert pool.allocate(0) == []


def test_allocate_too_many_raises_and_changes_nothing():
    pool = PagePool(num_pages=4, page_size=4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="only 1 are free"):
        pool.allocate(2)
    assert (pool.num_free, pool.num_used) == (1, 3)


def test_double_free_and_unknown_page_raise_without_side_effects():
    pool = PagePool(num_pages=4, page_size=4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError):
        pool.free(pages[:1])  # double free
    with pytest.raises(ValueError):
        pool.free([pages[1], 99])  # unknown page: all or nothing, pages[1] stays in use
    with pytest.raises(ValueError):
        pool.free([pages[1], pages[1]])  # listed twice
    with pytest.raises(ValueError):
        pool.free([3])  # valid id, never allocated
    assert (pool.num_free, pool.num_used) == (3, 1)
    pool.free([pages[1]])
    assert pool.num_free == 4


def test_admission_message_is_exact():
    pool = PagePool(num_pages=175, page_size=128)
    with pytest.raises(RequestTooLarge) as info:
        pool.check_admissible(24_212)
    assert str(info.value) == "request needs 190 pages (24,212 tokens) but the pool has 175 pages"
    assert isinstance(info.value, InvalidRequest)
    pool.check_admissible(175 * 128)  # exactly the pool fits
    with pytest.raises(RequestTooLarge, match=r"^request needs 176 pages \(22,401 tokens\)"):
        pool.check_admissible(175 * 128 + 1)


def test_ensure_capacity_grows_page_table():
    pool = PagePool(num_pages=4, page_size=4)
    seq = make_seq()
    assert pool.ensure_capacity(seq, 1)
    assert seq.page_ids == [0]
    assert pool.ensure_capacity(seq, 4)  # still one page
    assert seq.page_ids == [0]
    assert pool.ensure_capacity(seq, 9)
    assert seq.page_ids == [0, 1, 2]
    assert pool.ensure_capacity(seq, 2)  # already covered: never shrinks
    assert seq.page_ids == [0, 1, 2]
    assert pool.num_free == 1


def test_ensure_capacity_is_all_or_nothing():
    pool = PagePool(num_pages=4, page_size=4)
    other, seq = make_seq("other"), make_seq("seq")
    assert pool.ensure_capacity(other, 8)
    assert pool.ensure_capacity(seq, 4)
    assert not pool.ensure_capacity(seq, 13)  # needs 3 more pages, 1 free
    assert seq.page_ids == [2]
    assert pool.num_free == 1
    assert pool.ensure_capacity(seq, 8)
    assert seq.page_ids == [2, 3]


def test_release_frees_everything_and_clears_the_table():
    pool = PagePool(num_pages=4, page_size=4)
    seq = make_seq()
    pool.ensure_capacity(seq, 10)
    pool.release(seq)
    assert seq.page_ids == []
    assert pool.num_free == 4
    pool.release(seq)  # nothing left to free is fine
    assert pool.num_free == 4


def test_release_of_foreign_pages_raises():
    pool = PagePool(num_pages=4, page_size=4)
    seq = make_seq()
    seq.page_ids = [0, 1]  # never allocated from this pool
    with pytest.raises(ValueError):
        pool.release(seq)


def held_seq(pool: PagePool, keys: list[bytes], prompt_len: int, request_id: str = "r") -> Sequence:
    """A sequence of `prompt_len` tokens whose full pages have `keys`, its prompt computed and cached."""
    seq = Sequence(
        request_id, list(range(prompt_len)), max_tokens=1, prefix=PageKeys(keys, pool.page_size), data=None
    )
    pool.take_prefix(seq)
    assert pool.ensure_capacity(seq, prompt_len)
    seq.num_computed_tokens = prompt_len
    pool.cache_computed(seq)
    return seq


def accounted(pool: PagePool) -> None:
    assert pool.num_free + pool.num_used == pool.num_pages
    assert all(pool.holders(p) >= 0 for p in range(pool.num_pages))
    assert pool.num_used == sum(pool.holders(p) > 0 for p in range(pool.num_pages))


def test_a_released_cached_page_is_evictable_and_taken_back_by_its_key():
    pool = PagePool(num_pages=6, page_size=4)
    first = held_seq(pool, [b"a", b"b"], 10)  # two full pages cached, a third partial one not
    assert first.page_ids == [0, 1, 2] and first.num_cached_pages == 2
    assert (pool.num_used, pool.num_cached) == (3, 2)
    pool.release(first)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (6, 0, 2)  # evictable pages count as free
    accounted(pool)
    second = Sequence("s", list(range(12)), max_tokens=1, prefix=PageKeys([b"a", b"b", b"c"], 4), data=None)
    assert pool.take_prefix(second) == 8
    assert second.page_ids == [0, 1] and second.num_computed_tokens == 8
    assert (pool.queried_tokens, pool.hit_tokens) == (22, 8)  # the first queried 10 and hit none
    assert (pool.num_free, pool.num_used) == (4, 2)
    accounted(pool)


def test_a_page_held_by_several_counts_its_holders_and_frees_with_the_last():
    pool = PagePool(num_pages=4, page_size=2)
    first = held_seq(pool, [b"x"], 2, "first")
    second = Sequence("second", [0, 1, 5], max_tokens=1, prefix=PageKeys([b"x"], 2), data=None)
    assert pool.take_prefix(second) == 2
    assert pool.holders(0) == 2 and pool.num_used == 1
    pool.release(first)
    assert pool.holders(0) == 1 and pool.num_used == 1 and pool.num_free == 3
    with pytest.raises(ValueError):
        pool.free([0, 0])  # listed twice, though it has a holder to spare: a bug
    pool.release(second)
    assert pool.holders(0) == 0 and pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free([0])  # evictable, held by none: a double free
    accounted(pool)


def test_the_whole_prompt_cached_still_leaves_its_last_token_to_compute():
    pool = PagePool(num_pages=4, page_size=4)
    pool.release(held_seq(pool, [b"a", b"b"], 8))
    again = Sequence("again", list(range(8)), max_tokens=1, prefix=PageKeys([b"a", b"b"], 4), data=None)
    assert pool.take_prefix(again) == 4  # the second page is computed again, in a page of its own
    assert pool.ensure_capacity(again, 8) and again.page_ids == [0, 2]


def test_eviction_takes_free_pages_first_then_the_least_recently_released():
    pool = PagePool(num_pages=5, page_size=1)
    a = held_seq(pool, [b"a1", b"a2"], 2, "a")  # pages 0, 1
    b = held_seq(pool, [b"b1", b"b2"], 2, "b")  # pages 2, 3
    pool.release(b)
    pool.release(a)  # released last: evicted last; each sequence's tail before its head
    assert pool.allocate(1) == [4]  # a never-cached page before any cached one
    assert pool.allocate(1) == [3] and pool.num_cached == 3  # b's tail page, its key dropped
    assert pool.allocate(1) == [2]
    head = Sequence("h", [7, 8, 9], max_tokens=1, prefix=PageKeys([b"a1", b"a2"], 1), data=None)
    assert pool.take_prefix(head) == 2  # a's pages were spared
    assert head.page_ids == [0, 1] and pool.num_free == 0
    accounted(pool)


def test_an_evicted_key_misses_and_a_taken_page_is_never_evicted():
    pool = PagePool(num_pages=3, page_size=1)
    pool.release(held_seq(pool, [b"k"], 1, "a"))
    holder = Sequence("h", [0, 1], max_tokens=1, prefix=PageKeys([b"k"], 1), data=None)
    pool.take_prefix(holder)
    assert sorted(pool.allocate(2)) == [1, 2]  # page 0 is held: not evictable
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.release(holder)
    assert pool.allocate(1) == [0] and pool.num_cached == 0  # now evicted
    late = Sequence("l", [0, 1], max_tokens=1, prefix=PageKeys([b"k"], 1), data=None)
    assert pool.take_prefix(late) == 0 and late.page_ids == []


def test_a_key_computed_twice_at_once_keeps_the_first_page():
    pool = PagePool(num_pages=4, page_size=2)
    first, second = (
        Sequence(n, [1, 2, 3], max_tokens=1, prefix=PageKeys([b"k"], 2), data=None) for n in "ab"
    )
    for seq in (first, second):  # both admitted before either computed its page
        pool.take_prefix(seq)
        assert pool.ensure_capacity(seq, 3)
    for seq in (first, second):
        seq.num_computed_tokens = 3
        pool.cache_computed(seq)
    assert pool.cached_prefix([b"k"]) == [first.page_ids[0]] and pool.num_cached == 1
    pool.release(first)
    pool.release(second)
    assert pool.num_free == 4 and pool.num_cached == 1
    accounted(pool)


def test_untaking_a_prefix_undoes_it_and_its_counts():
    pool = PagePool(num_pages=4, page_size=2)
    pool.release(held_seq(pool, [b"k"], 2))
    queried, hits = pool.queried_tokens, pool.hit_tokens
    seq = Sequence("s", [1, 2, 3], max_tokens=1, prefix=PageKeys([b"k"], 2), data=None)
    found = pool.take_prefix(seq)
    pool.untake_prefix(seq, found)
    assert (pool.queried_tokens, pool.hit_tokens) == (queried, hits)
    assert seq.page_ids == [] and seq.num_computed_tokens == 0 and pool.num_free == 4
    assert pool.cached_prefix([b"k"]) == [0]


def test_a_sequence_without_keys_never_touches_the_cache():
    pool = PagePool(num_pages=2, page_size=2)
    seq = Sequence("s", [1, 2, 3], max_tokens=1, data=None)
    assert pool.take_prefix(seq) == 0 and pool.queried_tokens == 0
    assert pool.ensure_capacity(seq, 3)
    seq.num_computed_tokens = 3
    pool.cache_computed(seq)
    pool.release(seq)
    assert pool.num_cached == 0 and pool.num_free == 2


def answered(pool: PagePool, prompt: list[int], answer: list[int]) -> Sequence:
    """A sequence of `prompt` that sampled `answer`, its pages (4 rows each) computed to the last sampled id
    and cached: a prompt page, and one holding the prompt's tail and the answer's head."""
    seq = Sequence("a", prompt, max_tokens=8, prefix=PageKeys.of_prompt(prompt, 4), data=None)
    pool.take_prefix(seq)
    assert pool.ensure_capacity(seq, len(prompt) + len(answer))
    seq.output_token_ids = answer
    seq.num_computed_tokens = len(prompt) + len(answer) - 1  # the last sampled id is not computed
    pool.cache_computed(seq)
    return seq


def test_the_pages_a_sequence_decoded_are_cached_but_not_given_where_kept_rows_are_read():
    """A sequence's answer pages are entered as their rows are computed; a later prompt repeating prompt and
    answer takes them, unless it reads hidden rows kept beside a page that decode steps (which keep none)
    computed in part."""
    pool = PagePool(num_pages=8, page_size=4)
    prompt, answer = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    seq = answered(pool, prompt, answer)
    assert seq.num_cached_pages == 2 and pool.num_cached == 2  # rows 0-3, and 4-7 of prompt and answer
    pool.release(seq)
    accounted(pool)
    following = prompt + answer + [20, 21]
    for read, found in ((frozenset(), 8), (frozenset({0}), 8), (frozenset({1}), 4), (frozenset({2}), 8)):
        keys = PageKeys.of_prompt(following, 4, reads_kept_rows=read)
        later = Sequence("b", following, max_tokens=1, prefix=keys, data=None)
        assert pool.take_prefix(later) == found, read
        pool.release(later)
    assert pool.num_free == pool.num_pages


def test_a_prefilled_page_takes_the_key_of_one_decode_steps_computed():
    """A speaking turn cannot take the answer page decode steps computed (no hidden rows kept) and prefills it
    again: that page takes the key, so the next turn's speaking prompt finds it and the pages after it."""
    pool = PagePool(num_pages=8, page_size=4)
    prompt, answer = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    seq = answered(pool, prompt, answer)
    decoded = seq.page_ids[1]
    following = prompt + answer + [20, 21, 22, 23, 24]
    reading = frozenset({1, 2})  # the turn reads kept rows in its answer page and after it

    def speaking() -> Sequence:
        keys = PageKeys.of_prompt(following, 4, reads_kept_rows=reading)
        return Sequence("b", following, max_tokens=1, prefix=keys, data=None)

    turn = speaking()
    assert pool.take_prefix(turn) == 4  # stopped at the decoded page
    assert pool.ensure_capacity(turn, len(following))
    turn.num_computed_tokens = len(following)
    pool.cache_computed(turn)
    assert pool.cached_prefix(turn.prefix.keys) == turn.page_ids[:4]
    pool.release(seq)  # the decoded page, uncached now, is free once let go
    assert decoded not in pool.cached_prefix(turn.prefix.keys) and pool.holders(decoded) == 0
    pool.release(turn)
    accounted(pool)
    following = [*following[:16], 30]
    assert pool.take_prefix(speaking()) == 16  # every page, the prefilled answer page among them


def test_an_evictable_decoded_page_replaced_is_free_at_once():
    pool = PagePool(num_pages=4, page_size=2)
    first = Sequence("a", [1], max_tokens=4, prefix=PageKeys.of_prompt([1], 2), data=None)
    pool.take_prefix(first)
    assert pool.ensure_capacity(first, 3)
    first.output_token_ids = [2, 3]
    first.num_computed_tokens = 2
    pool.cache_computed(first)  # page 0: row 0 prompt, row 1 decoded
    pool.release(first)
    assert pool.num_cached == 1 and pool.num_free == 4
    again = Sequence("b", [1, 2, 9], max_tokens=1, prefix=PageKeys.of_prompt([1, 2, 9], 2), data=None)
    again.prefix.reads_kept_rows = frozenset({0})
    assert pool.take_prefix(again) == 0
    assert pool.ensure_capacity(again, 3)
    again.num_computed_tokens = 2
    pool.cache_computed(again)
    assert pool.cached_prefix(again.prefix.keys) == [again.page_ids[0]] and pool.num_cached == 1
    pool.release(again)
    accounted(pool)
