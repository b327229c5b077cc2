"""A live `omnistage serve --media-dir` (tiny checkpoint, CPU): videos through the openai client."""

from __future__ import annotations

import base64
import re

import openai
import pytest

from tests.server.conftest import SHARED_MODEL

FORCED = {"min_tokens": 4, "ignore_eos": True}


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def clip(shared_media_dir) -> bytes:
    return (shared_media_dir / "clip.mp4").read_bytes()  # 2 s with a tone


@pytest.fixture(scope="module")
def server(shared_media_server):
    return shared_media_server  # its media directory holds clip.mp4, long.mkv (4 s) and silent.webm


@pytest.fixture(scope="module")
def model() -> str:
    return SHARED_MODEL


def ask(client, model, url: str, extra: dict | None = None, **kwargs):
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0,
        extra_body={**FORCED, **(extra or {})}, **kwargs,
    )  # fmt: skip


def test_a_video_chat_answers_and_streams(client, model, clip):
    result = ask(client, model, data_url(clip))
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 4
    # 4 frames of 64x48, upscaled to the 128-token minimum: two temporal patches of 140 tokens
    assert result.usage.prompt_tokens > 280
    chunks = list(ask(client, model, data_url(clip), stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == result.choices[0].message.content
    )


def test_its_sound_track_adds_audio_tokens(client, model, clip):
    silent = ask(client, model, data_url(clip))
    heard = ask(client, model, data_url(clip), {"use_audio_in_video": True})
    again = ask(client, model, data_url(clip), {"mm_processor_kwargs": {"use_audio_in_video": True}})
    assert (
        heard.usage.prompt_tokens > silent.usage.prompt_tokens + 20
    )  # 2 s of audio: 26 tokens and 2 markers
    assert again.usage.prompt_tokens == heard.usage.prompt_tokens


def test_a_video_from_the_media_dir_and_its_overrides(client, model, clip):
    local = ask(client, model, "clip.mp4")
    assert local.usage.prompt_tokens == ask(client, model, data_url(clip)).usage.prompt_tokens

    def prompt_tokens(**extra) -> int:
        return ask(client, model, "long.mkv", extra).usage.prompt_tokens

    at_2fps, at_1fps, six = prompt_tokens(), prompt_tokens(video_fps=1), prompt_tokens(video_max_frames=6)
    text = at_2fps - 4 * 140  # 4 s at 2 fps: 8 frames, 4 temporal patches of 140 tokens
    assert at_1fps == text + 2 * 140 and six == text + 3 * 140


@pytest.mark.parametrize(
    ("url", "extra", "reason"),
    [
        ("data:video/mp4;base64," + base64.b64encode(b"not a video at all" * 50).decode(), {}, "corrupt"),
        ("silent.webm", {"use_audio_in_video": True}, "no audio track"),
        ("clip.mp4", {"video_fps": 30}, "fps 30 is not one the positions admit"),
        ("clip.mp4", {"video_fps": 2.6}, r"fps is 2 / k \(2, 1, 0.667, 0.5, ...\)"),
        ("clip.mp4", {"video_max_frames": 10_000}, r"max frames 10000 is outside \[1, 256\]"),
        ("missing.mp4", {}, "does not exist in the media directory"),
        ("https://example.com/v.mp4", {}, "--allow-remote-media"),
    ],
)
def test_bad_videos_are_400s_with_the_reason(client, model, url, extra, reason):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, model, url, extra)
    assert err.value.status_code == 400
    assert re.search(reason, err.value.message)
    assert "messages[0].content[0]" in err.value.message


def test_a_chats_next_turn_about_its_video_comes_from_the_caches(server, client, model, clip):
    """A chat sends its video with every turn: the next turn finds its video decoded, its vision rows and its
    sound track's rows in the encoder cache (the towers do not run), and the first turn's pages cached."""
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": content}]
    extra = {**FORCED, "use_audio_in_video": True}
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    before = server.metrics()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"omnistage_{name}"] - before[f"omnistage_{name}"]

    assert grew("encoder_cache_hits_total") == 2 and grew("encoder_cache_misses_total") == 0
    assert grew("prefix_cache_hits_total") >= first.usage.prompt_tokens // 16 * 16 - 16 > 0
    server.wait_pages_free(timeout=2)
