import numpy as np

from omnistage.engine.prefix_keys import MediaRows, page_keys

IDS = list(range(100, 110))  # two full pages of 4 and a partial one


def test_only_full_pages_have_keys_and_equal_prompts_equal_keys():
    keys = page_keys(IDS, 4, num_pages=10)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert page_keys(list(IDS), 4, num_pages=10) == keys
    assert page_keys(IDS, 4, num_pages=1) == keys[:1]
    assert page_keys(IDS[:3], 4, num_pages=10) == []


def test_a_page_key_chains_everything_before_it():
    changed_second = IDS[:5] + [0] + IDS[6:]
    assert page_keys(changed_second, 4, 2)[0] == page_keys(IDS, 4, 2)[0]
    assert page_keys(changed_second, 4, 2)[1] != page_keys(IDS, 4, 2)[1]
    changed_first = [0] + IDS[1:]
    first, second = page_keys(changed_first, 4, 2), page_keys(IDS, 4, 2)
    assert first[0] != second[0] and first[1] != second[1]  # its second page's ids are the same


def test_positions_are_part_of_the_key():
    positions = np.tile(np.arange(10), (3, 1))
    shifted = positions.copy()
    shifted[1, 5] += 1  # one stream of one row of the second page
    plain, same, other = (page_keys(IDS, 4, 2, p) for p in (None, positions, shifted))
    assert same[0] == other[0] and same[1] != other[1]
    assert plain == page_keys(IDS, 4, 2)


def test_placeholders_of_other_media_never_share_and_equal_rows_do():
    ids = [1, 9, 9, 9, 9, 9, 2, 3]  # 9: a placeholder, at rows 1-5 (over both pages)
    rows = np.arange(1, 6)
    picture = np.random.default_rng(0).integers(0, 256, (5, 8), dtype=np.uint8)
    other = picture.copy()
    other[4, 0] ^= 1  # one bit of the last row, in the second page
    keys = page_keys(ids, 4, 2, media=(MediaRows(rows, picture),))
    assert page_keys(ids, 4, 2, media=(MediaRows(rows, picture.copy()),)) == keys
    changed = page_keys(ids, 4, 2, media=(MediaRows(rows, other),))
    assert changed[0] == keys[0] and changed[1] != keys[1]
    assert page_keys(ids, 4, 2) != keys  # the ids alone are not the content
    # the same rows placed one row later are other content
    moved = page_keys([1, 2, 9, 9, 9, 9, 9, 3], 4, 2, media=(MediaRows(rows + 1, picture),))
    assert moved[0] != keys[0]


def test_two_kinds_of_media_in_one_page_are_told_apart():
    ids = [1, 7, 8, 2]
    audio, image = np.full((1, 4), 5, np.uint8), np.full((1, 4), 6, np.uint8)
    one = page_keys(ids, 4, 1, media=(MediaRows(np.array([1]), audio), MediaRows(np.array([2]), image)))
    swapped = page_keys(ids, 4, 1, media=(MediaRows(np.array([1]), image), MediaRows(np.array([2]), audio)))
    assert one != swapped
