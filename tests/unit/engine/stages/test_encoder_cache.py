"""The audio tower's rows kept on the host (tiny checkpoint, CPU): a clip sent again gives the very rows it gave
the first time, whatever it is batched beside, without the tower; the cache is bounded by bytes and can be off."""

import numpy as np
import pytest
import torch

from omnistage.config.loading import engine_config
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.qwen3_omni_encoders import load_encoders


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    return encoders, Processor(tiny_checkpoint)


def stage(loaded, cache_bytes: int) -> tuple[EncoderStage, list[int]]:
    """A stage over the loaded towers keeping `cache_bytes`, and the clips its audio tower is called with (the
    frames of each)."""
    encoders, _ = loaded
    fresh = EncoderStage(encoders.audio_encoder, encoders.audio, encoders.device, cache_bytes=cache_bytes)
    calls: list[int] = []
    tower = fresh.audio_encoder

    def counting(features: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.extend(f.shape[-1] for f in features)
        return tower(features)

    fresh.audio_encoder = counting  # type: ignore[assignment]
    return fresh, calls


def clip(seconds: float, pitch: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)


def prompt(loaded, *clips: np.ndarray):
    _, processor = loaded
    content = [{"type": "audio", "audio": c} for c in clips]
    return processor.process_chat([{"role": "user", "content": content}])


def clip_rows(encoders: EncoderStage, p) -> list[torch.Tensor]:
    """Each clip's rows in the prompt `p`, encoded as one request."""
    embeds = encoders.encode(p.token_ids, p.mm).audio_embeds
    assert embeds is not None
    return list(embeds.split(p.mm.num_audio_tokens))


def test_a_clip_beside_another_gets_the_rows_it_got_alone_without_the_tower(loaded):
    first, second = clip(0.6, 330.0), clip(0.9, 550.0)
    encoders, calls = stage(loaded, 64 << 20)
    alone = clip_rows(encoders, prompt(loaded, first))[0]
    frames = len(calls)
    assert frames == 1 and encoders.cache.misses == 1 and encoders.cache.hits == 0
    both = prompt(loaded, first, second)
    rows = clip_rows(encoders, both)
    assert torch.equal(rows[0], alone)  # bit for bit: the prefix cache keys pages by these bytes
    assert calls[frames:] == [both.mm.audio_clips[1].numel() // 160]  # the tower ran for the new clip only
    assert encoders.stats() == {
        "audio_graphs": 0,
        "vision_graphs": 0,
        "encoder_cache_hits": 1,
        "encoder_cache_misses": 2,
        "encoder_cache_bytes": sum(r.nbytes for r in rows),
    }
    # the same prompt again, and twice in one call: no tower at all, the same rows
    again = encoders.encode_many([(both.token_ids, both.mm)] * 2)
    assert len(calls) == frames + 1 and encoders.cache.hits == 5
    for embeds in again:
        assert torch.equal(embeds.audio_embeds, torch.cat(rows))


def test_a_clip_new_to_the_call_twice_runs_the_tower_once(loaded):
    encoders, calls = stage(loaded, 64 << 20)
    p = prompt(loaded, clip(0.5, 440.0), clip(0.5, 440.0))
    rows = clip_rows(encoders, p)
    assert len(calls) == 1 and torch.equal(rows[0], rows[1])
    assert (encoders.cache.misses, encoders.cache.hits) == (1, 1)


def test_the_least_recently_used_clips_leave_past_the_byte_budget(loaded):
    clips = [clip(0.5, 200.0 + 100 * i) for i in range(3)]  # clips of one length: rows of one size
    probe, _ = stage(loaded, 64 << 20)
    size = clip_rows(probe, prompt(loaded, clips[0]))[0].nbytes
    encoders, calls = stage(loaded, 2 * size)  # room for two clips' rows
    for c in clips[:2]:
        clip_rows(encoders, prompt(loaded, c))
    clip_rows(encoders, prompt(loaded, clips[0]))  # the first is now the most recently used
    assert len(calls) == 2 and encoders.cache.hits == 1
    clip_rows(encoders, prompt(loaded, clips[2]))  # in, the second out
    assert len(encoders.cache) == 2 and encoders.cache.bytes == 2 * size
    clip_rows(encoders, prompt(loaded, clips[0]))
    assert len(calls) == 3
    clip_rows(encoders, prompt(loaded, clips[1]))  # encoded again
    assert len(calls) == 4 and encoders.cache.bytes == 2 * size


def test_rows_larger_than_the_budget_are_not_kept(loaded):
    encoders, calls = stage(loaded, 1024)
    p = prompt(loaded, clip(0.5, 300.0))
    first, again = clip_rows(encoders, p)[0], clip_rows(encoders, p)[0]
    assert len(calls) == 2 and len(encoders.cache) == 0 and encoders.cache.bytes == 0
    torch.testing.assert_close(first, again)


def test_the_cache_off_runs_the_tower_for_every_clip(loaded):
    encoders, calls = stage(loaded, 0)
    p = prompt(loaded, clip(0.5, 300.0))
    clip_rows(encoders, p)
    clip_rows(encoders, p)
    assert len(calls) == 2 and not encoders.cache.enabled and len(encoders.cache) == 0
    assert (encoders.cache.hits, encoders.cache.misses) == (0, 0)


def test_its_size_is_a_setting_of_the_encoders_section():
    assert engine_config().stage("encoders").cache_bytes == 1024 << 20
    assert engine_config(encoder_cache_mib=0).stage("encoders").cache_bytes == 0
    assert engine_config(stages={"encoders": {"cache_mib": 8}}).stage("encoders").cache_bytes == 8 << 20


def test_a_clip_is_known_by_its_samples(loaded):
    """The processor's key: the same samples, the same key; a sample changed or the clip cut, another."""
    a = clip(0.5, 300.0)
    b = a.copy()
    b[100] += 1e-3
    keys = [prompt(loaded, x).mm.audio_keys for x in (a, a.copy(), b, a[:-1])]
    assert keys[0] == keys[1] and len(keys[0]) == 1
    assert len({k[0] for k in keys}) == 3


def test_clips_without_their_keys_are_refused(loaded):
    encoders, _ = stage(loaded, 64 << 20)
    p = prompt(loaded, clip(0.5, 300.0))
    p.mm.audio_keys = []
    with pytest.raises(ValueError, match="1 clips came with 0 keys"):
        encoders.encode(p.token_ids, p.mm)
