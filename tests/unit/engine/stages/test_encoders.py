from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage.engine.stages.encoders import EncoderStage
from omnistage.errors import InvalidRequest
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.pipeline.qwen3_omni_encoders import aut_clips, load_encoders


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    clip = (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hi"}]}
    ]
    return cfg, encoders, Processor(tiny_checkpoint).process_chat(messages)


def test_rows_point_at_the_placeholders(setup):
    cfg, encoders, prompt = setup
    embeds = encoders.encode(prompt.token_ids, prompt.mm)
    expected = [i for i, t in enumerate(prompt.token_ids) if t == cfg.audio_token_id]
    assert embeds.audio_rows.tolist() == expected
    assert embeds.audio_embeds.shape == (len(expected), cfg.text.hidden_size)
    assert embeds.image_embeds is None and embeds.deepstack is None and len(embeds.image_rows) == 0


def test_placeholders_that_do_not_match_the_media_are_refused(setup):
    cfg, encoders, prompt = setup
    ids = prompt.token_ids + [cfg.audio_token_id]
    count = ids.count(cfg.audio_token_id)
    with pytest.raises(InvalidRequest) as err:
        encoders.encode(ids, prompt.mm)
    assert (
        str(err.value) == f"the prompt has {count} audio placeholder tokens but its audio gives {count - 1}"
    )


def test_many_prompts_encode_together_as_each_alone(tiny_checkpoint, setup):
    """One ragged batch per tower over several prompts (clips of mixed lengths, images of mixed sizes, a
    prompt with both, one with neither tower) equals each prompt encoded alone."""
    from PIL import Image

    cfg, encoders, _ = setup
    rng = np.random.default_rng(0)

    def clip(seconds):
        return (0.3 * rng.standard_normal(round(seconds * 16000))).astype(np.float32)

    def picture(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    contents = [
        [{"type": "audio", "audio": clip(0.7)}, {"type": "text", "text": "a"}],
        [{"type": "image", "image": picture(56, 84)}, {"type": "audio", "audio": clip(2.3)}],
        [{"type": "image", "image": picture(112, 56)}, {"type": "image", "image": picture(28, 28)}],
        [{"type": "audio", "audio": clip(9.1)}, {"type": "audio", "audio": clip(1.0)}],
    ]
    processor = Processor(tiny_checkpoint)
    prompts = [processor.process_chat([{"role": "user", "content": c}]) for c in contents]
    together = encoders.encode_many([(p.token_ids, p.mm) for p in prompts])
    for prompt, got in zip(prompts, together):
        want = encoders.encode(prompt.token_ids, prompt.mm)
        for name in ("audio_rows", "audio_embeds", "image_rows", "image_embeds", "deepstack"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (
        together[2].audio_embeds is None and together[2].deepstack.shape[1] == together[2].image_rows.numel()
    )
    assert together[1].image_embeds is not None and together[1].audio_embeds is not None


def test_no_encoder_call_exceeds_the_largest_input_measured(tiny_checkpoint, monkeypatch):
    """Media admitted together go through each tower in calls of at most the largest single input the
    processor admits (what the memory plan measured), and still equal each prompt alone."""
    from PIL import Image

    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    assert encoders.max_audio_frames == 30000 and encoders.max_image_patches == 224 * 224
    encoders.max_audio_frames, encoders.max_image_patches = 450, 256  # 4.5 s of audio, one 256x256 image
    audio_calls, image_calls = [], []
    audio, vision = encoders.audio_encoder, encoders.vision_encoder
    monkeypatch.setattr(
        encoders,
        "audio_encoder",
        lambda clips: audio_calls.append(sum(c.shape[1] for c in clips)) or audio(clips),
    )
    monkeypatch.setattr(
        encoders, "vision_encoder", lambda px, grid: image_calls.append(px.shape[0]) or vision(px, grid)
    )
    rng = np.random.default_rng(1)
    clips = [
        (0.3 * rng.standard_normal(round(s * 16000))).astype(np.float32) for s in (4.5, 1.0, 2.0, 3.0, 0.5)
    ]
    pictures = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in ((256, 256), (64, 128), (128, 96))
    ]
    contents = [
        [{"type": "audio", "audio": clips[0]}, {"type": "image", "image": pictures[0]}],
        [{"type": "audio", "audio": clips[1]}, {"type": "audio", "audio": clips[2]}, {"type": "image", "image": pictures[1]}],
        [{"type": "image", "image": pictures[2]}, {"type": "audio", "audio": clips[3]}, {"type": "audio", "audio": clips[4]}],
    ]  # fmt: skip
    processor = Processor(tiny_checkpoint)
    prompts = [processor.process_chat([{"role": "user", "content": c}]) for c in contents]
    together = encoders.encode_many([(p.token_ids, p.mm) for p in prompts])
    assert audio_calls == [450, 100 + 200, 300 + 50] and image_calls == [256, 32 + 48]
    for prompt, got in zip(prompts, together):
        want = encoders.encode(prompt.token_ids, prompt.mm)
        for name in ("audio_embeds", "image_embeds", "deepstack"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)


def test_graphs_encode_as_the_eager_towers(tiny_checkpoint, setup):
    """With graphs captured (static-eager on the CPU), prompts' clips go through the audio graphs in pieces of
    packed chunks and their images through the vision graphs, or eagerly when larger than the largest bucket; every
    prompt's rows are the eager stage's."""
    from PIL import Image

    cfg, eager, _ = setup
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    assert encoders.captured == {"audio": [], "vision": []}
    encoders.capture_graphs([1, 2], [64, 128])
    assert encoders.captured == {"audio": [1, 2], "vision": [64, 128]}
    audio_calls, image_calls = [], []
    for graphs, calls in ((encoders.audio_graphs, audio_calls), (encoders.vision_graphs, image_calls)):
        graphs.on_replay = calls.append
    rng = np.random.default_rng(2)

    def clip(seconds):
        return (0.3 * rng.standard_normal(round(seconds * 16000))).astype(np.float32)

    def picture(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    contents = [
        [{"type": "audio", "audio": clip(9.1)}, {"type": "image", "image": picture(112, 64)}],
        [{"type": "image", "image": picture(224, 160)}, {"type": "audio", "audio": clip(17.0)}],
        [{"type": "audio", "audio": clip(1.0)}, {"type": "image", "image": picture(96, 96)}],
    ]  # fmt: skip
    processor = Processor(tiny_checkpoint)
    prompts = [processor.process_chat([{"role": "user", "content": c}]) for c in contents]
    got = encoders.encode_many([(p.token_ids, p.mm) for p in prompts])
    want = eager.encode_many([(p.token_ids, p.mm) for p in prompts])
    # 2 + 3 + 1 windows (10 + 17 + 1 chunks) in pieces of at most 2 windows' 16 chunk slots: 10, 16 and 2 chunks;
    # images of 32 and 36 patches in the 64-patch graph, 140 eagerly
    assert audio_calls == [2, 2, 1] and image_calls == [64, 64]
    assert encoders.stats() == {
        "audio_graphs": 2,
        "vision_graphs": 2,
        "encoder_cache_hits": 0,
        "encoder_cache_misses": 0,
        "encoder_cache_bytes": 0,
    }
    for g, w in zip(got, want):
        for name in ("audio_rows", "audio_embeds", "image_rows", "image_embeds", "deepstack"):
            torch.testing.assert_close(getattr(g, name), getattr(w, name), rtol=1e-5, atol=1e-5)


def test_a_stage_of_an_audio_tower_alone(setup):
    """Qwen3-ASR's stage: the AuT tower and its clips' format, no vision tower nor image placeholders; a
    vision tower comes with the format of its images."""
    cfg, omni, prompt = setup
    audio = EncoderStage(omni.audio_encoder, aut_clips(cfg.audio_token_id), torch.device("cpu"))
    assert (audio.name, audio.device, audio.max_audio_frames) == ("encoders", torch.device("cpu"), 30000)
    assert audio.default_graph_buckets()[1] == []
    assert audio.stats() == {
        "audio_graphs": 0,
        "vision_graphs": 0,
        "encoder_cache_hits": 0,
        "encoder_cache_misses": 0,
        "encoder_cache_bytes": 0,
    }
    embeds = audio.encode(prompt.token_ids, prompt.mm)
    torch.testing.assert_close(embeds.audio_embeds, omni.encode(prompt.token_ids, prompt.mm).audio_embeds)
    assert len(embeds.image_rows) == 0
    with pytest.raises(ValueError, match="a vision tower comes with its image format"):
        EncoderStage(omni.audio_encoder, omni.audio, torch.device("cpu"), omni.vision_encoder)


def test_videos_go_in_pieces_of_temporal_patches_and_keep_prompt_order(tiny_checkpoint, setup):
    """A video split into calls of whole temporal patches gives the rows of one call over it all, and a prompt
    of image, video, image gets each one's rows at its own placeholders."""
    from PIL import Image

    cfg, encoders, _ = setup
    rng = np.random.default_rng(1)
    video = rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)
    pictures = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]
    content = [
        {"type": "image", "image": pictures[0]},
        {"type": "video", "video": video},
        {"type": "image", "image": pictures[1]},
    ]
    prompt = Processor(tiny_checkpoint).process_chat([{"role": "user", "content": content}])
    whole = encoders.encode(prompt.token_ids, prompt.mm)
    (t, h, w) = prompt.mm.video_grid_thw[0].tolist()
    assert t == 3
    pieces = EncoderStage(
        encoders.audio_encoder, encoders.audio, encoders.device, encoders.vision_encoder, encoders.images,
        encoders.videos,
    )  # fmt: skip
    pieces.max_image_patches = h * w  # one temporal patch a call
    split = pieces.encode(prompt.token_ids, prompt.mm)
    torch.testing.assert_close(split.image_embeds, whole.image_embeds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.deepstack, whole.deepstack, rtol=1e-5, atol=1e-5)

    ids = torch.tensor(prompt.token_ids)
    vision = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    assert whole.image_rows.tolist() == vision.nonzero().flatten().tolist()
    for i, picture in enumerate(pictures):  # each image's rows as it gives them alone
        alone = Processor(tiny_checkpoint).process_chat(
            [{"role": "user", "content": [{"type": "image", "image": picture}]}]
        )
        rows = encoders.encode(alone.token_ids, alone.mm).image_embeds
        n = len(rows)
        got = whole.image_embeds[:n] if i == 0 else whole.image_embeds[-n:]
        torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-5)


def test_a_video_no_graph_holds_goes_eagerly_in_pieces(tiny_checkpoint, setup):
    """Frame pairs larger than every captured vision graph (an 80 GB card keeps the smallest) go through the
    eager tower a few pairs a call (`max_video_patches`), not one pair a call; the rows are the whole video's."""
    from omnistage.bench.videos import encode, frames
    from omnistage.models.qwen3_omni.video_decoding import decode_video
    from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig

    cfg, eager, _ = setup
    encoders = load_encoders(tiny_checkpoint, cfg, LoadOptions(torch.float32, torch.device("cpu")))
    encoders.capture_graphs([1], [64])
    data = encode(frames(60, 224, 160, seed=3), fps=10, kind="mp4")
    video = decode_video(data, VideoProcessorConfig())
    messages = [
        {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "?"}]}
    ]
    prompt = Processor(tiny_checkpoint).process_chat(messages)
    t, h, w = prompt.mm.video_grid_thw.tolist()[0]
    assert t == 6 and h * w > 64  # six frame pairs, each over the largest graph
    encoders.max_video_patches = 2 * h * w
    calls: list[int] = []
    tower = encoders.vision_encoder
    forward = tower.forward
    tower.forward = lambda pixels, grids: calls.append(len(pixels)) or forward(pixels, grids)
    got = encoders.encode(prompt.token_ids, prompt.mm)
    want = eager.encode(prompt.token_ids, prompt.mm)
    assert calls == [2 * h * w] * 3
    assert got.image_embeds is not None and len(got.image_rows) == t * h * w // 4
    for name in ("image_rows", "image_embeds", "deepstack"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)


def test_clips_featurised_together_get_the_rows_of_their_own_features(setup):
    """The stage makes the features of all the clips it admits at once (`AudioFormat.features`): each clip's
    rows are the tower's on its own `log_mel`."""
    from omnistage.models.qwen3_omni.audio_features import log_mel

    cfg, encoders, prompt = setup
    rng = np.random.default_rng(3)
    waves = [
        torch.from_numpy((0.3 * rng.standard_normal(n)).astype(np.float32)) for n in (11_200, 52_017, 32_000)
    ]
    prompts = [
        (
            [cfg.audio_token_id] * encoders.audio_encoder.output_tokens(w.numel() // 160),
            replace(prompt.mm, audio_clips=[w], audio_keys=[b"%d" % i]),
        )
        for i, w in enumerate(waves)
    ]
    for wave, got in zip(waves, encoders.encode_many(prompts, cached=False)):
        (want,) = encoders.audio_encoder([log_mel(wave)])
        torch.testing.assert_close(got.audio_embeds, want, rtol=1e-5, atol=1e-5)
