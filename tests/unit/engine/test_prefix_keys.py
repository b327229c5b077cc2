import numpy as np

from omnistage.engine.prefix_keys import MediaRows, PageKeys, page_keys

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


def test_the_pages_sampled_ids_fill_get_the_keys_of_a_prompt_that_repeats_them():
    """A sequence keys its prompt's pages, then those its sampled ids fill, each row past the prompt at its
    index + delta in every stream: the keys a prompt holding the same ids at the same positions computes, the
    media rows of the page that the prompt and its answer share included."""
    # rows 4 and 5 hold media; page 1 (rows 4-7) ends with the first answer row
    prompt = [1, 2, 3, 4, 9, 9, 5]
    positions = np.array([[0, 1, 2, 3, 4, 4, 6], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 4, 6]])
    media = (MediaRows(np.array([4, 5]), np.arange(12, dtype=np.uint8).reshape(2, 6)),)
    keys = PageKeys.of_prompt(prompt, 4, positions, 0, media)
    assert keys.keys == page_keys(prompt, 4, 1, positions, media)
    answered = prompt + [6, 7, 8, 10, 11, 12]
    keys.extend(3, lambda start, stop: answered[start:stop])
    repeated = np.concatenate([positions, np.broadcast_to(np.arange(7, 13), (3, 6))], axis=1)
    assert keys.keys == page_keys(answered, 4, 3, repeated, media)
    shifted = PageKeys.of_prompt(prompt, 4, positions, 1, media)
    shifted.extend(3, lambda start, stop: answered[start:stop])
    assert shifted.keys[0] == keys.keys[0] and shifted.keys[1:] != keys.keys[1:]


def test_a_page_whose_ids_are_not_all_known_is_keyed_once_they_are():
    keys = PageKeys.of_prompt([1, 2, 3, 4, 5], 4)
    ids = [1, 2, 3, 4, 5, 6, 7, -1, 9]  # the eighth decoded ahead, its value still on its way
    keys.extend(2, lambda start, stop: ids[start:stop])
    assert len(keys.keys) == 1
    ids[7] = 8
    keys.extend(2, lambda start, stop: ids[start:stop])
    assert keys.keys == page_keys(ids, 4, 2)


def test_no_page_from_the_bound_on_is_keyed():
    ids = list(range(1, 17))
    keys = PageKeys.of_prompt(ids[:10], 4, end=1)
    keys.extend(4, lambda start, stop: ids[start:stop])
    assert keys.keys == page_keys(ids, 4, 1)


def test_keys_made_a_page_at_a_time_equal_those_made_at_once():
    """A sequence keys its pages as their ids become known, each call after the rows keyed before it: the keys
    of every page, media rows split across calls included, are those of keying the whole at once."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 150_000, 45).tolist()
    audio = MediaRows(np.arange(3, 19), rng.integers(0, 256, (16, 6), dtype=np.uint8))
    image = MediaRows(np.array([21, 22, 30, 37]), rng.integers(0, 256, (4, 6), dtype=np.uint8))
    whole = page_keys(ids, 4, 11, media=(audio, image))
    assert len(whole) == 11 and len(set(whole)) == 11
    for steps in ([1] * 11, [3, 2, 5, 1], [11]):
        keys = PageKeys([], 4, media=(audio, image))
        pages = 0
        for step in steps:
            pages += step
            keys.extend(pages, lambda start, stop: ids[start:stop])
        assert keys.keys == whole
