import pytest

from omnistage.engine.kv_cache import PagePool
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
