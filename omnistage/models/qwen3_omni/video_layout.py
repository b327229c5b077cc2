"""A video with its sound track in the Thinker's prompt (`use_audio_in_video`, TMRoPE), laid out as in training.

The template renders a video as `<|vision_start|><|video_pad|><|vision_end|>`. With its sound track the pad
becomes `<|audio_start|>`, the video's and the track's tokens merged in time order, `<|audio_end|>`: audio
token a (of 12.5 a second) stands at time a, a frame token at its temporal patch's time (t x step, `step` =
seconds per temporal patch x position_id_per_seconds); a frame token goes first where the times tie. The
tokens keep those times as their temporal M-RoPE positions (mrope.py), so sound and picture line up.
"""

from __future__ import annotations

import torch


def frame_times(grid: tuple[int, int, int], merge: int, step: int) -> torch.Tensor:
    """long `[t * h * w / merge^2]`: the temporal position offset of each of a video's tokens, frame by frame."""
    t, h, w = (int(x) for x in grid)
    return (torch.arange(t) * step).repeat_interleave((h // merge) * (w // merge))


def interleaved(times: torch.Tensor, audio: int) -> torch.Tensor:
    """bool `[len(times) + audio]`: True where a frame token stands once the `audio` tokens (at times 0, 1,
    ...) are merged with frame tokens at `times` (ascending), a frame first on a tie."""
    is_video = torch.zeros(len(times) + audio, dtype=torch.bool)
    # frame j follows j frames and the audio tokens earlier than it, those at times below its own
    before = torch.clamp(torch.ceil(times.to(torch.float64)).long(), 0, audio)
    is_video[torch.arange(len(times)) + before] = True
    return is_video


def with_audio_tokens(times: torch.Tensor, audio: int, video_token: int, audio_token: int) -> list[int]:
    """The placeholder ids of a video and its sound track merged in time order."""
    return torch.where(interleaved(times, audio), video_token, audio_token).tolist()
