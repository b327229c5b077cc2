"""Videos against transformers' Qwen3-Omni processor and thinker (CPU, float32, tiny checkpoint).

Videos are encoded on the fly with PyAV and decoded once by our decoder; both sides get the same sampled
frames and sound tracks. transformers' processor lays out the placeholders (interleaving a video's sound
track with its frames under `use_audio_in_video`) and its `get_rope_index` places them; its video patches
come from the stub of media_samples.py (transformers' video processors need torchvision).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from media_samples import audio, clips_alone, image, picture, speech, text
from test_multimodal_parity import prefill_logits

from omnistage import LLM, SamplingParams
from omnistage.bench.videos import encode, frames
from omnistage.models.qwen3_omni.processor import Processor
from omnistage.models.qwen3_omni.video_decoding import decode_video
from omnistage.models.qwen3_omni.video_processing import VideoProcessorConfig

STEPS = 8


def video(seconds: float, with_audio: bool, seed: int = 0, kind: str = "mkv") -> dict:
    """A decoded video part: `seconds` of 64x48 frames at 10 fps, with a tone's sound track (opus in mkv
    decodes to whole 10 ms hops, as test_processor_parity's clips are)."""
    data = encode(
        frames(round(seconds * 10), 64, 48, seed=seed), fps=10, kind=kind, tone_hz=330.0 + 50 * seed
    )
    return {"type": "video", "video": decode_video(data, VideoProcessorConfig(), with_audio=with_audio)}


CASES = {
    "video": (False, lambda: [{"role": "user", "content": [video(2.0, False), text("What happens?")]}]),
    "video_with_audio": (
        True,
        lambda: [{"role": "user", "content": [text("Watch and listen."), video(2.5, True)]}],
    ),
    "video_image_clip": (
        True,
        lambda: [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [audio(speech()), text("then"), video(2.0, True, seed=1)]},
            {"role": "assistant", "content": "Seen."},
            {"role": "user", "content": [image(picture(64, 96)), video(1.0, True, seed=2), text("Compare.")]},
        ],
    ),
}


def hf_inputs(hf_processor, prompt: str, messages: list[dict], use_audio_in_video: bool):
    """transformers' processor on the same rendered prompt and media: clips in prompt order, a video's sound
    track among them in its place when use_audio_in_video."""
    clips, images, videos = [], [], []
    sources: list[int | None] = []  # per clip: the video whose sound track it is, or None
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "audio":
                clips.append(part["audio"])
                sources.append(None)
            elif part["type"] == "image":
                images.append(part["image"])
            elif part["type"] == "video":
                videos.append(part["video"].frames)
                if use_audio_in_video:
                    clips.append(part["video"].audio)
                    sources.append(len(videos) - 1)
    # transformers 5.25 counts a prompt's audio placeholders against the clips that are not a video's sound
    # track, which it is told of; 5.17 has no such argument
    told = (
        {"audio_from_video_indices": sources} if use_audio_in_video and _takes_sources(hf_processor) else {}
    )
    ref = hf_processor(
        text=prompt,
        audio=clips or None,
        images=images or None,
        videos=videos,
        fps=2.0,
        use_audio_in_video=use_audio_in_video,
        return_tensors="pt",
        **told,
    )
    return ref, clips


def _takes_sources(processor) -> bool:
    """Whether the processor's call takes `audio_from_video_indices` (transformers 5.25 and later)."""
    calls = (vars(cls)["__call__"] for cls in type(processor).__mro__ if "__call__" in vars(cls))
    return any("audio_from_video_indices" in inspect.signature(call).parameters for call in calls)


@pytest.fixture(scope="module")
def ours(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=1024)


@pytest.mark.parametrize("case", CASES)
def test_placeholders_and_positions_match_transformers(case, ours, hf_processor, hf_thinker):
    with_audio, build = CASES[case]
    messages = build()
    got = ours.process_chat(messages, use_audio_in_video=with_audio)
    ref, _ = hf_inputs(hf_processor, got.prompt, messages, with_audio)
    assert got.token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(got.mm.video_grid_thw, ref["video_grid_thw"])
    assert sum(got.mm.num_video_tokens) == got.token_ids.count(hf_thinker.config.video_token_id)
    feature_mask = ref.get("feature_attention_mask")
    positions, deltas = hf_thinker.get_rope_index(
        ref["input_ids"],
        image_grid_thw=ref.get("image_grid_thw"),
        video_grid_thw=ref["video_grid_thw"],
        attention_mask=ref["attention_mask"],
        use_audio_in_video=with_audio,
        audio_seqlens=None if feature_mask is None else feature_mask.sum(-1),
        second_per_grids=torch.as_tensor(ref["video_second_per_grid"]),
    )
    assert got.mrope is not None
    assert torch.equal(got.mrope.positions, positions[:, 0].long())
    assert got.mrope.delta == int(deltas.item())


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case, llm, hf_processor, hf_thinker):
    with_audio, build = CASES[case]
    messages = build()
    out, ours = prefill_logits(llm, messages, use_audio_in_video=with_audio)
    ref, clips = hf_inputs(hf_processor, out.prompt, messages, with_audio)
    clip_parts = [{"role": "user", "content": [audio(c) for c in clips]}]
    ref = dict(clips_alone(hf_processor, ref, clip_parts))
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    with torch.no_grad():
        theirs = hf_thinker(**ref, use_audio_in_video=with_audio).logits[0, -1]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4

    params = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, temperature=0.0, ignore_eos=True)
    tokens = llm.chat(messages, params, use_audio_in_video=with_audio)[0].outputs[0].token_ids
    with torch.no_grad():
        generated = hf_thinker.generate(
            **ref, use_audio_in_video=with_audio, do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS
        )
    assert tokens == generated[0, ref["input_ids"].shape[1] :].tolist()
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    # transformers 5.17's talker lays out a prompt with audio and a picture by the thinker's rules, reading
    # `config.audio_config.n_window`, which its own config lacks (AttributeError): the thinker's is meant
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model


SPEECH_CASES = {"video": CASES["video"], "video_image_clip": (False, CASES["video_image_clip"][1])}


def speak(llm, messages, with_audio: bool):
    from test_speech_parity import REPETITION_PENALTY, TALKER_STEPS, THINKER_STEPS

    talker = SamplingParams(
        max_tokens=TALKER_STEPS - 1, temperature=0.0, repetition_penalty=REPETITION_PENALTY
    )
    return llm.chat(
        messages,
        SamplingParams(max_tokens=THINKER_STEPS, temperature=0.0),
        modalities=["text", "audio"],
        voice="chelsie",
        talker_params=talker,
        use_audio_in_video=with_audio,
    )[0]


@pytest.mark.parametrize("case", SPEECH_CASES)
def test_speech_from_a_video_prompt_gives_transformers_codes(case, llm, hf_processor, hf_model):
    """The Talker's prompt takes the Thinker's hidden rows at the video's positions, placed by the same M-RoPE:
    `LLM.chat(modalities=["text", "audio"])` gives transformers' greedy codes."""
    from test_speech_parity import TALKER_STEPS, THINKER_STEPS, reference

    with_audio, build = SPEECH_CASES[case]
    messages = build()
    out = speak(llm, messages, with_audio)
    inputs, _ = hf_inputs(hf_processor, out.prompt, messages, with_audio)
    im_end = hf_processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ref = reference(hf_model, inputs, "chelsie", THINKER_STEPS, TALKER_STEPS, im_end)
    assert out.prompt_token_ids + out.outputs[0].token_ids == ref.sequences
    assert out.audio_codes == ref.codes.tolist()
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_speech_from_a_video_with_its_sound_track(llm):
    """No oracle here: transformers 5.17's generate does not pass use_audio_in_video to its talker, which then
    places the merged block as one run of audio positions, unlike its thinker. Ours lays the Talker's prompt out
    as the Thinker's (TMRoPE) and speaks."""
    from test_speech_parity import TALKER_STEPS

    out = speak(llm, CASES["video_with_audio"][1](), True)
    assert len(out.audio_codes) == TALKER_STEPS - 1 and out.audio is not None
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_a_video_prompt_prefilled_in_chunks_gives_the_same_tokens(tiny_checkpoint, llm):
    """A per-step budget of 16 tokens cuts the prefill inside the interleaved frames and sound: the rows and
    deepstack levels of each chunk are its own share, so the greedy tokens are the one-chunk prefill's."""
    with_audio, build = CASES["video_image_clip"]
    messages = build()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    whole = llm.chat(messages, params, use_audio_in_video=with_audio)[0].outputs[0].token_ids
    chunked = LLM(
        model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=1024,
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert chunked.chat(messages, params, use_audio_in_video=with_audio)[0].outputs[0].token_ids == whole
    assert chunked.engine.pool.num_free == chunked.engine.pool.num_pages
