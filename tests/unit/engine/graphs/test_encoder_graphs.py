"""The encoder graphs' padded static path (run static-eager on the CPU, over the buffers a capture records)
against the plain eager towers, float32, tiny checkpoints of both families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.engine.graphs.encoders import AudioGraphs, VisionGraphs, audio_buckets, vision_buckets
from omnistage.models.layers.varlen_attention import Segments, varlen_attention
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_asr.audio_encoder import load_audio_encoder as load_asr_audio_encoder
from omnistage.models.qwen3_asr.tiny import make_tiny as make_tiny_asr
from omnistage.models.qwen3_omni.audio_encoder import audio_windows, load_audio_encoder
from omnistage.models.qwen3_omni.audio_features import log_mel
from omnistage.models.qwen3_omni.vision_encoder import load_vision_encoder

# 1 s, 7 s, 9 s and 31 s sit on and across the 8 s windows; 2.35 s ends in a part of a 1 s chunk.
SECONDS = (1.0, 7.0, 9.0, 31.0, 2.35)  # 1 + 1 + 2 + 4 + 1 = 9 windows


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def audio_towers(tiny_checkpoint, tmp_path_factory) -> dict:
    asr = make_tiny_asr(tmp_path_factory.mktemp("asr"))
    return {
        "qwen3-omni": load_audio_encoder(tiny_checkpoint, LoadOptions(torch.float32, "cpu")),
        "qwen3-asr": load_asr_audio_encoder(asr, LoadOptions(torch.float32, "cpu")),
    }


@pytest.fixture(scope="module")
def clips() -> list[torch.Tensor]:
    rng = np.random.default_rng(0)
    waves = [(0.3 * rng.standard_normal(round(s * 16000))).astype(np.float32) for s in SECONDS]
    return log_mel(waves)


def recording(graphs) -> list[int]:
    """The buckets `graphs` replays, in order."""
    calls: list[int] = []
    graphs.on_replay = calls.append
    return calls


@pytest.mark.parametrize("family", ["qwen3-omni", "qwen3-asr"])
@pytest.mark.parametrize(
    ("buckets", "replayed"),
    [([1, 2, 4, 16], [16]), ([2, 4], [4, 4]), ([1, 2, 4, 8], [8])],
    ids=["padding", "pieces", "packed"],
)
def test_padded_windows_equal_the_eager_tower(audio_towers, clips, family, buckets, replayed):
    """Clips batched together through the padded static path give every clip's rows as the eager tower does:
    their 9 windows' 51 chunks packed into one bucket of 16 windows' slots (128 chunks), or in pieces of the
    largest bucket's 32 chunks (25 and 26 of them), or into 8 windows' 64 chunk slots, fewer windows' than
    they are (each window in 8 slots would take two calls of 8)."""
    tower = audio_towers[family]
    graphs = AudioGraphs(tower, max(buckets))
    assert graphs.capture(buckets) == buckets
    calls = recording(graphs)
    with torch.inference_mode():
        got, want = graphs.run(clips), tower(clips)
    assert calls == replayed
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        close(g, w)


def test_many_short_clips_fill_a_bucket_with_one_window_each(audio_towers):
    """Clips under a second are a window of one short chunk each: 21 of them in pieces of a 2-window bucket's 16
    chunk slots (16, then 5 in the 1-window bucket) give the eager tower's rows, as many segments as windows."""
    rng = np.random.default_rng(1)
    waves = [
        (0.3 * rng.standard_normal(round(s * 16000))).astype(np.float32) for s in rng.uniform(0.2, 0.95, 21)
    ]
    short = log_mel(waves)
    tower = audio_towers["qwen3-asr"]
    graphs = AudioGraphs(tower, 2)
    graphs.capture([1, 2])
    calls = recording(graphs)
    with torch.inference_mode():
        got, want = graphs.run(short), tower(short)
    assert calls == [2, 1]
    for g, w in zip(got, want, strict=True):
        close(g, w)


def test_audio_padding_cannot_reach_real_tokens(audio_towers, clips):
    """Whatever the padding chunks hold (here large noise), the real windows' rows are the same."""
    tower = audio_towers["qwen3-omni"]
    graphs = AudioGraphs(tower, 8)
    graphs.capture([8])
    cfg = tower.cfg
    packed = torch.cat(clips[:3], dim=-1)  # 1 s, 7 s, 9 s: 4 windows in 8 slots, 3 of them short
    windows = audio_windows([c.shape[-1] for c in clips[:3]], cfg.n_window, cfg.n_window_infer)
    with torch.inference_mode():
        real = graphs.buffers.fill(packed, windows, 8)  # the real rows lead the output
        clean = graphs.replay(8)[:real].clone()
        chunks = graphs.buffers.chunks
        empty = chunks.abs().sum((1, 2)) == 0
        assert empty.sum() == 8 * 8 - (1 + 7 + 8 + 1)  # every chunk slot no clip fills
        chunks[empty] = 100 * torch.randn_like(chunks[empty])
        close(graphs.replay(8)[:real], clean)
        close(clean, torch.cat(tower(clips[:3])))


@pytest.fixture(scope="module")
def vision_tower(tiny_checkpoint):
    return load_vision_encoder(tiny_checkpoint, LoadOptions(torch.float32, "cpu"))


def patches(tower, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    width = tower.patch_embed.proj.weight[0].numel()
    return torch.randn(sum(t * h * w for t, h, w in grids), width, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("grids", "bucket"),
    [([(1, 4, 6), (1, 8, 10)], 128), ([(1, 8, 10)], 128), ([(1, 4, 6)], 64), ([(1, 8, 8)], 64)],
)
def test_padded_images_equal_the_eager_tower(vision_tower, grids, bucket):
    """Images of two sizes, together and alone, padded to a patch bucket: their rows and deepstack levels are
    the eager tower's."""
    graphs = VisionGraphs(vision_tower, [64, 128, 256], max_frames=4)
    assert graphs.capture([64, 128, 256]) == [64, 128, 256]
    calls = recording(graphs)
    pixels = patches(vision_tower, grids)
    with torch.inference_mode():
        embeds, deepstack = graphs.run(pixels, grids)
        want, want_deepstack = vision_tower(pixels, grids)
    assert calls == [bucket]
    close(embeds, want)
    close(deepstack, torch.stack(want_deepstack))


def test_vision_padding_cannot_reach_real_patches(vision_tower):
    graphs = VisionGraphs(vision_tower, [128], max_frames=4)
    graphs.capture([128])
    grids = [(1, 4, 6), (1, 6, 8)]  # 72 patches, 56 of padding
    pixels = patches(vision_tower, grids)
    with torch.inference_mode():
        graphs.buffers.fill(pixels, grids, 128)
        for buffer in (graphs.buffers.pixels, graphs.buffers.positions, graphs.buffers.cos):
            buffer[72:] = 100 * torch.randn_like(buffer[72:])
        embeds, deepstack = graphs.replay(128)
        want, want_deepstack = vision_tower(pixels, grids)
    close(embeds[:18], want)
    close(torch.stack([d[:18] for d in deepstack]), torch.stack(want_deepstack))


def test_what_no_vision_graph_holds_is_left_to_the_eager_tower(vision_tower):
    graphs = VisionGraphs(vision_tower, [64, 128], max_frames=2)
    graphs.capture([64, 128])
    with torch.inference_mode():
        too_large = [(1, 12, 12)]  # 144 patches
        too_many = [(1, 2, 2)] * 3  # three frames
        assert graphs.run(patches(vision_tower, too_large), too_large) is None
        assert graphs.run(patches(vision_tower, too_many), too_many) is None
    with pytest.raises(ValueError, match="multiples of 4"):
        VisionGraphs(vision_tower, [64, 130])


def test_static_segments_with_empty_ones_equal_the_host_segments():
    """A static layout's empty segments attend to nothing; the others are the host segments'."""
    q, k, v = torch.randn(3, 10, 2, 8).unbind(0)
    static = Segments.static(torch.tensor([0, 4, 4, 4, 9, 10, 10], dtype=torch.int32), 6)
    close(varlen_attention(q, k, v, static), varlen_attention(q, k, v, [0, 4, 9, 10]))


def test_default_buckets():
    # the longest admitted clip, 300 s, has 38 windows; a 1920x1080 image 8160 patches
    assert audio_buckets(38) == [1, 2, 4, 8, 16, 24, 32]
    assert audio_buckets(3) == [1, 2, 3]
    assert vision_buckets(224 * 224) == [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert vision_buckets(1000) == [256, 384, 512, 768, 1000]
    assert vision_buckets(102) == [100]


@pytest.mark.parametrize("family", ["qwen3-omni", "qwen3-asr"])
def test_the_warm_up_runs_every_bucket_over_its_own_padding(audio_towers, family):
    # before capture every bucket's step runs once (on a GPU, for cuBLAS and Triton); a smaller bucket over the
    # largest one's padding read segment bounds past its rows, which FlashAttention took as an illegal address
    graphs = AudioGraphs(audio_towers[family], 32)
    seen: list[list[int]] = []
    step = graphs.step

    def checked(chunks, order, segments):
        bounds = segments.host_bounds()
        seen.append(bounds)
        assert bounds == sorted(bounds) and bounds[-1] == len(order), bounds
        return step(chunks, order, segments)

    graphs.step = checked
    buckets = audio_buckets(32)
    graphs._warm_up(sorted(buckets, reverse=True))
    assert len(seen) == len(buckets)
