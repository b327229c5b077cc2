"""Local media paths under --media-dir: whatever the path holds, the answer is an InvalidMedia, never an
OSError or ValueError escaping as a 500."""

from __future__ import annotations

import pytest

from omnistage.errors import InvalidMedia
from omnistage.media import MediaPolicy, fetch


@pytest.fixture
def policy(tmp_path) -> MediaPolicy:
    (tmp_path / "clip.wav").write_bytes(b"RIFF")
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    return MediaPolicy(media_dir=tmp_path)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("clip\x00.wav", "the path holds a NUL character"),
        ("file:///clip%00.wav", "the path holds a NUL character"),
        ("loop-a", "loop-a cannot be resolved"),
        ("x" * 5000, "cannot be read"),
        ("missing.wav", "missing.wav does not exist in the media directory"),
        ("../outside.wav", "is outside the media directory"),
    ],
    ids=["nul", "nul-in-file-url", "symlink-loop", "name-too-long", "missing", "outside"],
)
def test_bad_paths_are_invalid_media(policy, url, message):
    with pytest.raises(InvalidMedia, match=message):
        fetch(url, policy)


def test_a_file_under_the_directory_is_read(policy):
    assert fetch("clip.wav", policy) == b"RIFF"
    assert fetch(f"file://{policy.media_dir}/clip.wav", policy) == b"RIFF"
