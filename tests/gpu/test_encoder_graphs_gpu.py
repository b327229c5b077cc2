"""Encoder CUDA graphs on a GPU (bf16, tiny checkpoints of both families): the fused attention's empty
segments, captured graphs replaying what the eager towers give, and the planner's measured costs per bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.bench.videos import encode, frames
from omnistage.engine.compile_watch import watch_compiles
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.models.layers.varlen_attention import Segments, _grouped_sdpa, varlen_attention
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_asr.audio_encoder import load_audio_encoder as load_asr_audio_encoder
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig
from omnistage.models.qwen3_asr.processor import ASRProcessor
from omnistage.models.qwen3_asr.tiny import make_tiny as make_tiny_asr
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.video_decoding import decode_video
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig
from omnistage.pipeline.qwen3_omni_encoders import aut_clips, load_encoders

pytestmark = pytest.mark.gpu

SECONDS = (1.0, 7.0, 9.0, 31.0, 2.35)
AUDIO_BUCKETS = [1, 2, 4, 8]


def wave(seconds: float, seed: int) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal(round(seconds * 16000))).astype(np.float32)


def assert_bf16_close(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert (got is None) == (want is None)
    if want is not None:
        assert got.shape == want.shape and got.dtype == want.dtype
        # GEMMs over other row counts round differently in bf16: noise of a few ulps of the largest value
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_fused_attention_leaves_empty_segments_out():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = torch.randn(3, 300, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16).unbind(0)
    cu = torch.tensor([0, 104, 104, 130, 208, 208, 300, 300], dtype=torch.int32, device="cuda")
    got = varlen_attention(q, k, v, Segments.static(cu, 104)).float()
    want = _grouped_sdpa(q.float(), k.float(), v.float(), [0, 104, 130, 208, 300])
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def encode_twice(encoders: EncoderStage, prompts: list, audio: list[int], vision: list[int]):
    """The eager rows, then the graphs' (after measuring their costs and capturing them)."""
    inputs = [(p.token_ids, p.mm) for p in prompts]
    eager = encoders.encode_many(inputs)
    costs = encoders.graph_costs(audio, vision)
    for tower, buckets in (("audio", audio), ("vision", vision)):
        if buckets:  # every graph takes memory, keeps its rows, and most of its peak is scratch
            peaks = costs[tower]
            assert sorted(peaks) == buckets and all(0 < p.kept < p.bytes for p in peaks.values()), costs
    encoders.capture_graphs(audio, vision, pool=torch.cuda.graph_pool_handle())
    assert encoders.captured == {"audio": audio, "vision": vision}
    assert encoders.audio_graphs.graph_count == len(audio)  # real CUDA graphs, not static-eager calls
    graphs = encoders.encode_many(inputs)
    again = encoders.encode_many(inputs)  # replays are deterministic
    for g, a in zip(graphs, again):
        for name in ("audio_embeds", "image_embeds", "deepstack"):
            assert (getattr(g, name) is None) or torch.equal(getattr(g, name), getattr(a, name))
    return eager, graphs


def test_qwen3_omni_graphs_equal_eager(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.bfloat16, torch.device("cuda")))
    rng = np.random.default_rng(0)

    def picture(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    contents = [
        [{"type": "audio", "audio": wave(s, i)}, {"type": "image", "image": picture(*size)}]
        for i, (s, size) in enumerate(
            zip(SECONDS, [(224, 160), (320, 256), (448, 448), (224, 160), (320, 256)])
        )
    ]  # images of 140 and 320 patches in graphs, 784 eagerly
    processor = Processor(tiny_checkpoint)
    prompts = [processor.process_chat([{"role": "user", "content": c}]) for c in contents]
    eager, graphs = encode_twice(encoders, prompts, AUDIO_BUCKETS, [256, 512])
    assert encoders.vision_graphs.graph_count == 2
    for g, e in zip(graphs, eager):
        assert torch.equal(g.audio_rows, e.audio_rows) and torch.equal(g.image_rows, e.image_rows)
        for name in ("audio_embeds", "image_embeds", "deepstack"):
            assert_bf16_close(getattr(g, name), getattr(e, name))


def test_qwen3_omni_videos_in_graph_pieces_equal_eager(tiny_checkpoint):
    """Videos with their sound, beside an image: the vision tower takes them in pieces of whole temporal patches
    that fit its graphs, and the rows equal the eager tower's."""
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.bfloat16, torch.device("cuda")))
    processor = Processor(tiny_checkpoint)

    def video(seconds: float, width: int, height: int, seed: int) -> dict:
        data = encode(
            frames(round(seconds * 10), width, height, seed=seed), fps=10, kind="mkv", tone_hz=330.0
        )
        return {"type": "video", "video": decode_video(data, VideoProcessorConfig(), with_audio=True)}

    rng = np.random.default_rng(1)
    picture = Image.fromarray(rng.integers(0, 256, (160, 224, 3), dtype=np.uint8))
    contents = [
        [video(6.0, 224, 160, 0), {"type": "text", "text": "What happens?"}],
        [{"type": "image", "image": picture}, video(3.0, 160, 128, 1)],
    ]
    prompts = [
        processor.process_chat([{"role": "user", "content": c}], use_audio_in_video=True) for c in contents
    ]
    assert all(sum(p.mm.num_video_tokens) > 0 for p in prompts)
    # a temporal patch of these videos is 560-572 patches (the video processor's minimum size): the 2,048 bucket
    # holds a piece of three, the image goes into the 256 one
    eager, graphs = encode_twice(encoders, prompts, AUDIO_BUCKETS, [256, 2048])
    assert encoders.vision_graphs.graph_count == 2
    for g, e in zip(graphs, eager):
        assert torch.equal(g.audio_rows, e.audio_rows) and torch.equal(g.image_rows, e.image_rows)
        for name in ("audio_embeds", "image_embeds", "deepstack"):
            assert_bf16_close(getattr(g, name), getattr(e, name))


def test_qwen3_asr_graphs_equal_eager(tmp_path):
    path = make_tiny_asr(tmp_path / "asr")
    tower = load_asr_audio_encoder(path, LoadOptions(torch.bfloat16, torch.device("cuda")))
    token = Qwen3ASRConfig.from_dir(path).audio_token_id
    encoders = EncoderStage(tower, aut_clips(token), torch.device("cuda"))
    processor = ASRProcessor(path)
    prompts = [processor.transcription(wave(s, i), None, None) for i, s in enumerate(SECONDS)]
    eager, graphs = encode_twice(encoders, prompts, AUDIO_BUCKETS, [])
    for g, e in zip(graphs, eager):
        assert torch.equal(g.audio_rows, e.audio_rows)
        assert_bf16_close(g.audio_embeds, e.audio_embeds)


def test_compiled_vision_tower_equals_eager_and_builds_nothing_after_start(tiny_checkpoint):
    """`compile_regions` (what a GPU server runs before its stage's measurements): images and a video of patch
    counts never seen before, eagerly and through the graphs, give the eager tower's rows and build nothing once
    the start's two calls (the floor's largest image, the graphs' capture) have compiled the blocks."""
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.bfloat16, torch.device("cuda")))
    processor = Processor(tiny_checkpoint)
    rng = np.random.default_rng(2)

    def picture(w: int, h: int) -> dict:
        return {"type": "image", "image": Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))}

    clip = encode(frames(30, 192, 128, seed=3), fps=10, kind="mkv", tone_hz=330.0)
    seen = {"type": "video", "video": decode_video(clip, VideoProcessorConfig(), with_audio=True)}
    contents = [[picture(224, 160)], [picture(480, 320), picture(96, 64)], [seen, picture(320, 256)]]
    prompts = [
        processor.process_chat([{"role": "user", "content": c}], use_audio_in_video=True) for c in contents
    ]
    inputs = [(p.token_ids, p.mm) for p in prompts]
    eager = encoders.encode_many(inputs)
    encoders.vision_encoder.compile_regions()
    encoders.encode_many([(prompts[1].token_ids, prompts[1].mm)])  # the start's eager call
    encoders.capture_graphs([], [256], pool=torch.cuda.graph_pool_handle())  # and its capture
    watch = watch_compiles()
    before = len(watch.builds)
    compiled = encoders.encode_many(inputs)  # 140 patches in the graph; 600, 24 and the video's eagerly
    torch.cuda.synchronize()
    assert watch.builds[before:] == []
    for c, e in zip(compiled, eager):
        assert torch.equal(c.image_rows, e.image_rows)
        for name in ("image_embeds", "deepstack"):
            assert_bf16_close(getattr(c, name), getattr(e, name))
