"""Our Processor and M-RoPE positions against transformers' Qwen3OmniMoeProcessor and thinker (CPU, tiny checkpoint).

transformers' processor is built by hand, not through AutoProcessor (whose Qwen2-VL image and video
processors need torchvision, absent here): WhisperFeatureExtractor, the PIL image processor, the
checkpoint's tokenizer and a stub video processor. Clip lengths are whole 10 ms hops, where the frame
count of a clip in transformers' padded batch equals its count alone (see `test_clip_frames_are_batch_free`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from media_samples import audio, image, media, picture, reference, speech, text, tones

from omnistage.bench.hf_layout import rope_deltas, text_model
from omnistage.engine.stages.token_runner import positions_for
from omnistage.errors import InvalidMedia, InvalidRequest
from omnistage.models.qwen3_omni.audio_features import log_mel
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import rope_positions
from omnistage.models.qwen3_omni.processor import Processor

MEL_TOLERANCE = 1e-4
GENERATED = 4  # decode steps whose positions are compared


@pytest.fixture(scope="module")
def ours(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


CASES = {
    "one_audio": lambda: [{"role": "user", "content": [audio(speech()), text("What is said?")]}],
    "two_audios_one_image": lambda: [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [audio(tones(0.7)), text("and"), image(picture(64, 96)), text("then")]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [audio(tones(2.3, seed=1)), text("Describe both.")]},
    ],
    "image_only": lambda: [
        {"role": "user", "content": [image(picture(128, 64, seed=2)), text("What is this?")]}
    ],
    "image_first_two_images": lambda: [
        {
            "role": "user",
            "content": [image(picture(128, 64, seed=3)), image(picture(64, 96, seed=4)), audio(speech())],
        }
    ],
    "text_only": lambda: [{"role": "user", "content": "Hello there, how are you?"}],
}


@pytest.mark.parametrize("case", CASES)
def test_placeholders_features_and_patches(case, ours, hf_processor):
    messages = CASES[case]()
    got = ours.process_chat(messages)
    ref = reference(hf_processor, got.prompt, messages)
    assert got.token_ids == ref["input_ids"][0].tolist()
    if media(messages, "audio") is None and media(messages, "image") is None:
        assert got.mm is None and got.mrope is None
        return
    if "feature_attention_mask" in ref:
        lengths = ref["feature_attention_mask"].sum(-1).tolist()
        # each clip's waveform, whose features the encoder stage makes (`log_mels`, each clip's `log_mel`)
        assert [log_mel(f).shape[1] for f in got.mm.audio_clips] == lengths
        # Features against the extractor on each clip alone: padding to the batch's longest clip changes the
        # last frame of a shorter one, and we featurise every clip on its own (see audio_features.py).
        for waveform, clip in zip(got.mm.audio_clips, media(messages, "audio")):
            feature = log_mel(waveform)
            alone = reference(hf_processor, "<|audio_pad|>", [{"content": [audio(clip)]}])["input_features"][
                0
            ]
            assert (feature - alone).abs().max().item() <= MEL_TOLERANCE
        assert sum(got.mm.num_audio_tokens) == got.token_ids.count(ours._config().audio_token_id)
    else:
        assert got.mm.audio_clips == []
    if "image_grid_thw" in ref:
        assert torch.equal(got.mm.image_grid_thw, ref["image_grid_thw"])
        assert got.mm.pixel_values.dtype == torch.uint8 and got.mm.image_norm is not None
        assert (got.mm.image_norm(got.mm.pixel_values) - ref["pixel_values"]).abs().max().item() <= 1e-6
        assert sum(got.mm.num_image_tokens) == got.token_ids.count(ours._config().image_token_id)
    else:
        assert got.mm.pixel_values is None and got.mm.image_grid_thw is None


@pytest.mark.parametrize("case", CASES)
def test_rope_positions_prefill_and_decode(case, ours, hf_processor, hf_thinker, tiny_checkpoint):
    """Prompt positions and delta equal get_rope_index's; generate's decode positions equal p + delta."""
    messages = CASES[case]()
    got = ours.process_chat(messages)
    ref = reference(hf_processor, got.prompt, messages)
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    grids = (
        []
        if got.mm is None or got.mm.image_grid_thw is None
        else [tuple(g) for g in got.mm.image_grid_thw.tolist()]
    )
    mine = rope_positions(got.token_ids, grids, [] if got.mm is None else got.mm.num_audio_tokens, cfg)
    feature_mask = ref.get("feature_attention_mask")
    positions, deltas = hf_thinker.get_rope_index(
        ref["input_ids"],
        image_grid_thw=ref.get("image_grid_thw"),
        attention_mask=ref["attention_mask"],
        audio_seqlens=None if feature_mask is None else feature_mask.sum(-1),
    )
    assert torch.equal(mine.positions, positions[:, 0].long())
    assert mine.delta == int(deltas.item())
    # The engine gets None where the positions are plain 0..L-1 (no image); they must be exactly that.
    if got.mrope is None:
        assert "image_grid_thw" not in ref and mine.delta == 0
        assert torch.equal(mine.positions, torch.arange(len(got.token_ids)).expand(3, -1))
    else:
        assert torch.equal(got.mrope.positions, mine.positions) and got.mrope.delta == mine.delta

    seen = []  # the [4, 1, n] position ids (text row, then the 3 rope streams) of every forward
    hook = text_model(hf_thinker).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True
    )
    try:
        hf_thinker.generate(**ref, max_new_tokens=GENERATED, min_new_tokens=GENERATED, do_sample=False)
    finally:
        hook.remove()
    assert int(rope_deltas(hf_thinker).item()) == mine.delta
    prompt_len = len(got.token_ids)
    assert torch.equal(seen[0][1:, 0].long(), mine.positions)
    for k, step in enumerate(seen[1:]):
        expected = positions_for(prompt_len + k, 1, got.mrope)
        assert torch.equal(step[1:, 0].long(), expected), f"decode step {k}"
    assert len(seen) == GENERATED


def test_clip_frames_are_batch_free(ours, hf_processor):
    """A clip alone matches transformers at any length. In transformers' padded batch a shorter clip whose
    length is not a whole hop counts one frame more than alone; we featurise every clip alone."""
    clip = tones(1.2345)
    messages = [{"role": "user", "content": [audio(clip)]}]
    got = ours.process_chat(messages)
    ref = reference(hf_processor, got.prompt, messages)
    assert got.token_ids == ref["input_ids"][0].tolist()
    frames = log_mel(got.mm.audio_clips[0]).shape[1]
    assert frames == len(clip) // 160 == int(ref["feature_attention_mask"].sum())


def test_clips_are_handed_as_their_float32_samples(ours):
    """The engine's encoder stage makes a clip's features; the processor hands it the samples given, as
    float32 (a float64 clip converted once)."""
    clip = tones(2.5)
    for given in (clip, clip.astype(np.float64), torch.from_numpy(clip)):
        got = ours.process_chat([{"role": "user", "content": [audio(given)]}])
        (waveform,) = got.mm.audio_clips
        assert waveform.dtype == torch.float32 and torch.equal(waveform, torch.from_numpy(clip))


def test_limits_and_malformed_parts(tiny_checkpoint):
    processor = Processor(tiny_checkpoint, max_audios=2, max_images=1)
    short = tones(0.1)
    with pytest.raises(InvalidMedia, match=r"too many audio attachments: 3 \(the limit is 2\)"):
        processor.process_chat([{"role": "user", "content": [audio(short)] * 3}])
    with pytest.raises(InvalidMedia, match=r"too many image attachments: 2 \(the limit is 1\)"):
        processor.process_chat([{"role": "user", "content": [image(picture(32, 32))] * 2}])
    assert Processor(tiny_checkpoint).max_audios == 8 and Processor(tiny_checkpoint).max_images == 8
    with pytest.raises(InvalidMedia, match=r"messages\[0\]\.content\[1\]: audio is too short"):
        processor.process_chat([{"role": "user", "content": [text("hi"), audio(np.zeros(100, np.float32))]}])
    with pytest.raises(InvalidMedia, match=r"messages\[0\]\.content\[0\]: audio is too long"):
        processor.process_chat([{"role": "user", "content": [audio(np.zeros(16000 * 301, np.float32))]}])
    with pytest.raises(InvalidMedia, match="NaN"):
        processor.process_chat([{"role": "user", "content": [audio(np.full(1600, np.nan, np.float32))]}])
    for bad in ([np.inf], [np.inf, -np.inf], [-np.inf, np.nan]):
        samples = np.concatenate([tones(0.1), np.array(bad, np.float32)])
        with pytest.raises(InvalidMedia, match="NaN or infinite"):
            processor.process_chat([{"role": "user", "content": [audio(samples)]}])
    loud = np.full(1600, 3e38, np.float32)  # finite samples whose sum overflows: accepted
    (accepted,) = processor.process_chat([{"role": "user", "content": [audio(loud)]}]).mm.audio_clips
    assert log_mel(accepted).shape == (128, 10)
    with pytest.raises(InvalidMedia, match="aspect ratio"):
        processor.process_chat([{"role": "user", "content": [image(picture(2000, 4))]}])
    with pytest.raises(InvalidMedia, match="must be a PIL image"):
        processor.process_chat([{"role": "user", "content": [image(np.zeros((8, 8, 3)))]}])
    with pytest.raises(InvalidMedia, match="must be decoded"):
        processor.process_chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    with pytest.raises(InvalidMedia, match="video must be sampled frames"):
        processor.process_chat([{"role": "user", "content": [{"type": "video", "video": []}]}])


def test_rope_positions_rejects_mismatched_runs(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    pad, img = cfg.audio_token_id, cfg.image_token_id
    assert rope_positions([1, pad, pad, 2], [], [2], cfg).delta == 0
    with pytest.raises(InvalidRequest, match="does not hold the 3 tokens"):
        rope_positions([1, pad, pad, 2], [], [3], cfg)
    with pytest.raises(InvalidRequest, match="more audio placeholder runs"):
        rope_positions([1, pad, pad, 2], [], [1], cfg)
    with pytest.raises(InvalidRequest, match="fewer image placeholder runs"):
        rope_positions([1, 2], [(1, 4, 4)], [], cfg)
    # A 4x6 patch grid merges to 2x3 tokens at (row, col) offsets from the run's first position.
    got = rope_positions([7, img, img, img, img, img, img, 8], [(1, 4, 6)], [], cfg)
    assert got.positions.tolist() == [
        [0, 1, 1, 1, 1, 1, 1, 4],
        [0, 1, 1, 1, 2, 2, 2, 4],
        [0, 1, 2, 3, 1, 2, 3, 4],
    ]
    assert got.delta == 5 - 8


def test_a_clip_is_copied_from_the_callers_buffer(ours):
    """The engine reads a request's clip when it admits it: a caller reusing its buffer meanwhile changes
    nothing."""
    buffer = tones(1.0)
    got = ours.process_chat([{"role": "user", "content": [audio(buffer)]}])
    want = torch.from_numpy(buffer.copy())
    buffer[:] = 0.0
    assert torch.equal(got.mm.audio_clips[0], want)
