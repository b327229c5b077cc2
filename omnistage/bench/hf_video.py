"""transformers' `generate(return_audio=True, use_audio_in_video=True)` on our pipeline's very weights: the
baseline of `omnistage bench v2s` (the model `hf_speech.build_hf_omni` builds).

transformers' video processors need torchvision, so its model is fed what our decoder and processor made of
the same file (their placeholders, positions and patches equal transformers' processor's: the video parity
tests): prompt ids, `pixel_values_videos`, `video_grid_thw`, `video_second_per_grid` and the sound track's mel
features. Decoding and layout run inside each request's time, as ours do. Lengths are forced as in
`hf_speech`; a length that does not fit in memory is a note, not the end of the run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from omnistage.bench.hf_baseline import _FirstToken, _sync, prompt_inputs
from omnistage.bench.hf_layout import visual
from omnistage.bench.hf_speech import counting_frames, forced, forced_generate
from omnistage.bench.speech_targets import SpeechTiming
from omnistage.bench.video_targets import VideoInput
from omnistage.media import MediaPolicy, decode_messages
from omnistage.models.qwen3_omni.audio_features import log_mel
from omnistage.outputs import AUDIO_SAMPLE_RATE

log = logging.getLogger(__name__)


def video_inputs(mm: Any, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """A laid-out video prompt's media as transformers' generate takes them: the patches, their grid and
    seconds per temporal patch, and the sound track (the prompt's only clip) as mel features."""
    (features,) = [log_mel(clip) for clip in mm.audio_clips]
    return {
        "pixel_values_videos": mm.video_norm(mm.pixel_values_videos).to(device, dtype),
        "video_grid_thw": mm.video_grid_thw.to(device),
        "video_second_per_grid": torch.tensor(mm.video_seconds_per_grid, device=device),
        "input_features": features[None].to(device, dtype),
        "feature_attention_mask": torch.ones(1, features.shape[-1], dtype=torch.long, device=device),
        "use_audio_in_video": True,
    }


@torch.inference_mode()
def run_hf_video(
    hf: Any,
    processor: Any,
    policy: MediaPolicy,
    item: VideoInput,
    text_tokens: int,
    frames: int,
    voice: str,
    requests: int,
) -> list[SpeechTiming]:
    """A short warm-up, then `requests` requests of `item`, one at a time, each timed from the file to the
    waveform (its first text token seen by a streamer)."""
    device = hf.thinker.device
    dtype = visual(hf.thinker).dtype
    if not hasattr(hf.talker.config, "audio_config"):
        # transformers 5.17's talker lays a prompt with audio out by the thinker's rules, reading
        # `config.audio_config.n_window`, which its own config lacks (AttributeError): the thinker's is meant
        hf.talker.config.audio_config = hf.config.thinker_config.audio_config
    eos = processor.tokenizer.token_to_id("<|im_end|>")

    def generate(text: int, audio: int) -> SpeechTiming:
        _sync(device)
        start = time.perf_counter()
        decoded = decode_messages(item.messages(), policy, item.options())
        prompt = processor.process_chat(decoded, True, None, True)
        prepared = time.perf_counter()
        first = _FirstToken(device)
        with counting_frames(hf) as counts:
            inputs = prompt_inputs(prompt.token_ids, device) | video_inputs(prompt.mm, dtype, device)
            sequences, waveform = forced_generate(hf, inputs, voice, text, audio, eos, first)
        _sync(device)
        end = time.perf_counter()
        stages = {"preprocess": prepared - start, "first_text_token": (first.at or end) - start}
        seconds = waveform.shape[-1] / AUDIO_SAMPLE_RATE
        made = sequences.shape[1] - len(prompt.token_ids)
        return SpeechTiming(end - start, end - start, seconds, counts[0], made, stages)

    generate(min(text_tokens, 4), min(frames, 4))  # warm-up
    timings = []
    for _ in range(requests):
        t = generate(text_tokens, frames)
        log.info("transformers: %s: TTFT %.0f ms, %d frames (%.2f s of audio) in %.2f s", item.name,
                 t.stages["first_text_token"] * 1e3, t.frames, t.audio_s, t.latency_s)  # fmt: skip
        timings.append(forced(t, text_tokens, frames))
    return timings
