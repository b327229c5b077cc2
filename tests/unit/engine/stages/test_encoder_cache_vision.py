"""Images' and videos' vision rows kept on the host (tiny checkpoint, CPU): a video or an image sent again gives
the very rows and deepstack levels it gave the first time, whatever it is batched beside, without the vision
tower (a chat about a video sends the video with every turn); the kept bytes count the levels too."""

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.engine.stages.encoders import EncoderStage
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.qwen3_omni_encoders import load_encoders


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    return encoders, Processor(tiny_checkpoint), cfg


def stage(loaded, cache_bytes: int) -> tuple[EncoderStage, list[int]]:
    """A stage over the loaded towers keeping `cache_bytes`, and the patches of each vision tower call."""
    encoders = loaded[0]
    fresh = EncoderStage(
        encoders.audio_encoder, encoders.audio, encoders.device, encoders.vision_encoder, encoders.images,
        encoders.videos, cache_bytes=cache_bytes,
    )  # fmt: skip
    calls: list[int] = []
    tower = fresh.vision_encoder

    def counting(patches, grids):
        calls.append(len(patches))
        return tower(patches, grids)

    fresh.vision_encoder = counting  # type: ignore[assignment]
    return fresh, calls


rng = np.random.default_rng(7)
VIDEO = rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)  # 3 temporal patches of 3 x 4 blocks of 2 x 2
PICTURES = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]


def prompt(loaded, *parts):
    processor = loaded[1]
    content = [
        {"type": "video", "video": p} if isinstance(p, np.ndarray) else {"type": "image", "image": p}
        for p in parts
    ]
    return processor.process_chat([{"role": "user", "content": content}])


def encoded(encoders: EncoderStage, p):
    embeds = encoders.encode(p.token_ids, p.mm)
    return embeds.image_embeds, embeds.deepstack


def test_a_video_sent_again_gets_its_rows_bit_for_bit_without_the_tower(loaded):
    encoders, calls = stage(loaded, 64 << 20)
    first = prompt(loaded, VIDEO)
    rows, levels = encoded(encoders, first)
    assert len(calls) == 1 and (encoders.cache.hits, encoders.cache.misses) == (0, 1)
    assert encoders.cache.bytes == rows.nbytes + levels.nbytes  # its deepstack levels are kept with it
    # the next turn: an image before the video and one after; only the new images go through the tower
    turn = prompt(loaded, PICTURES[0], VIDEO, PICTURES[1])
    got_rows, got_levels = encoded(encoders, turn)
    assert calls[1:] == [2 * 4 * 4]  # one call of the two 56 x 56 images' 4 x 4 patches each
    ids, cfg = torch.tensor(turn.token_ids), loaded[2]
    vision = ids[(ids == cfg.image_token_id) | (ids == cfg.video_token_id)]
    video_rows = (vision == cfg.video_token_id).nonzero().flatten()
    assert len(video_rows) == len(rows)
    assert torch.equal(got_rows[video_rows], rows) and torch.equal(got_levels[:, video_rows], levels)
    # and each image's rows where it stands, as a stage keeping nothing gives them
    plain, _ = stage(loaded, 0)
    want_rows, want_levels = encoded(plain, turn)
    torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_levels, want_levels, rtol=1e-5, atol=1e-5)
    # the same turn twice in one call: no tower at all
    again = encoders.encode_many([(turn.token_ids, turn.mm)] * 2)
    assert len(calls) == 2 and encoders.cache.hits == 1 + 6
    for embeds in again:
        assert torch.equal(embeds.image_embeds, got_rows) and torch.equal(embeds.deepstack, got_levels)


def test_a_video_new_to_the_call_twice_runs_the_tower_once(loaded):
    encoders, calls = stage(loaded, 64 << 20)
    rows, _ = encoded(encoders, prompt(loaded, VIDEO, VIDEO))
    half = len(rows) // 2
    assert len(calls) == 1 and torch.equal(rows[:half], rows[half:])
    assert (encoders.cache.misses, encoders.cache.hits) == (1, 1)


def test_an_image_or_a_video_is_known_by_its_patches(loaded):
    changed = VIDEO.copy()
    changed[5, 10, 10, 0] ^= 1  # one value of the last frame
    keys = [prompt(loaded, v).mm.video_keys for v in (VIDEO, VIDEO.copy(), changed, VIDEO[:4])]
    assert keys[0] == keys[1] and len(keys[0]) == 1 and len({k[0] for k in keys}) == 3
    both = prompt(loaded, PICTURES[0], PICTURES[1]).mm.image_keys
    assert len(both) == 2 and both[0] != both[1] and both[0] == prompt(loaded, PICTURES[0]).mm.image_keys[0]


def test_media_without_their_keys_go_through_the_tower(loaded):
    encoders, calls = stage(loaded, 64 << 20)
    p = prompt(loaded, VIDEO)
    p.mm.video_keys = []
    encoded(encoders, p)
    encoded(encoders, p)
    assert len(calls) == 2 and len(encoders.cache) == 0 and encoders.cache.hits == 0


def test_the_cache_off_runs_the_tower_for_every_video(loaded):
    encoders, calls = stage(loaded, 0)
    p = prompt(loaded, VIDEO)
    first, again = encoded(encoders, p), encoded(encoders, p)
    assert len(calls) == 2 and (encoders.cache.hits, encoders.cache.misses) == (0, 0)
    torch.testing.assert_close(first, again)
