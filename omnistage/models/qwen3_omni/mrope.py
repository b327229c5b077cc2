"""The Thinker's 3-stream M-RoPE positions (temporal, height, width) for a prompt of text, audio, images, videos.

The rules of transformers' `get_rope_index` for Qwen3-Omni: a text token takes the next position in all
three streams; an audio clip's tokens do too (audio is 1-D, so an audio-only prompt is plain 0..L-1); an
image's tokens start at the next position s and lie on its merged grid, (s + t * position_id_per_seconds,
s + row, s + col); a video's the same with its temporal patches `step` apart (their seconds times
position_id_per_seconds). A video with its sound track (`use_audio_in_video`) is one block: its audio tokens
at s, s + 1, ... and its frames' tokens merged with them in time order (video_layout.py). Whatever follows a
block starts one past the block's largest position. A generated token at sequence index p >= L then sits at
p + delta in all three streams, delta = (largest position + 1) - L.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from omnistage.errors import InvalidRequest
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.multimodal import MultimodalInputs
from omnistage.models.qwen3_omni.config import ThinkerConfig
from omnistage.models.qwen3_omni.video_layout import frame_times, interleaved


@dataclass(frozen=True)
class VideoLayout:
    grid: tuple[int, int, int]  # (t, h, w) patches
    step: int  # positions between two temporal patches
    with_audio: bool  # its sound track's tokens are interleaved with its frames' (use_audio_in_video)


@dataclass(frozen=True)
class MediaLayout:
    """What a prompt's positions depend on besides its ids, in prompt order: plain numbers, kept after the
    media tensors are gone."""

    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    audio_tokens: list[int] = field(default_factory=list)  # clips and videos' sound tracks, in prompt order
    videos: list[VideoLayout] = field(default_factory=list)

    @classmethod
    def of(cls, mm: MultimodalInputs | None, cfg: ThinkerConfig) -> MediaLayout:
        if mm is None:
            return cls()
        images = [] if mm.image_grid_thw is None else [tuple(g) for g in mm.image_grid_thw.tolist()]
        video_grids = [] if mm.video_grid_thw is None else [tuple(g) for g in mm.video_grid_thw.tolist()]
        videos = [
            VideoLayout(grid, round(seconds * cfg.position_id_per_seconds), mm.use_audio_in_video)
            for grid, seconds in zip(video_grids, mm.video_seconds_per_grid)
        ]
        return cls(images, list(mm.num_audio_tokens), videos)

    @property
    def spatial(self) -> bool:
        """Whether any position differs from its index (an image or a video)."""
        return bool(self.image_grids or self.videos)

    def positions(self, token_ids: list[int] | torch.Tensor, cfg: ThinkerConfig) -> PromptPositions:
        return rope_positions(token_ids, self.image_grids, self.audio_tokens, cfg, self.videos)


def rope_positions(
    token_ids: list[int] | torch.Tensor,
    image_grids: list[tuple[int, int, int]],
    audio_token_counts: list[int],
    cfg: ThinkerConfig,
    videos: Sequence[VideoLayout] = (),
) -> PromptPositions:
    """Positions `[3, L]` of an expanded prompt (its ids, or a long tensor of them: the checks run as tensor
    ops, as a 30 s video's 22k ids would be slow to compare one by one); its placeholder runs must match the
    grids and counts, in order."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    placeholders = torch.tensor([cfg.audio_token_id, cfg.image_token_id, cfg.video_token_id])
    positions = torch.empty(3, len(token_ids), dtype=torch.long)
    grids, counts, clips = iter(image_grids), iter(audio_token_counts), iter(videos)
    cursor = next_pos = 0  # next token to place, and the position it takes if it is text
    found = torch.isin(ids, placeholders).nonzero().flatten()
    while (k := int(torch.searchsorted(found, cursor))) < len(found):  # the first placeholder past the blocks
        i = int(found[k])
        positions[:, cursor:i] = torch.arange(next_pos, next_pos + i - cursor)
        next_pos += i - cursor
        token = int(ids[i])
        merge = cfg.vision.spatial_merge_size
        if token == cfg.image_token_id:
            kind, block = "image", _image_block(_take(grids, "image"), merge, cfg.position_id_per_seconds)
            expected = torch.full((block.shape[1],), token)
        elif token == cfg.audio_token_id:
            kind, block = "audio", torch.arange(_take(counts, "audio")).expand(3, -1)
            expected = torch.full((block.shape[1],), token)
        else:
            video = _take(clips, "video")
            kind, block = "video", _image_block(video.grid, merge, video.step)
            expected = torch.full((block.shape[1],), token)
            if video.with_audio:
                block, expected = _with_audio(block, _take(counts, "audio"), cfg)
        n = block.shape[1]
        if n == 0 or not torch.equal(ids[i : i + n], expected):
            raise InvalidRequest(
                f"the {kind} placeholder run at token {i} does not hold the {n} tokens its media gives"
            )
        positions[:, i : i + n] = block + next_pos
        next_pos += int(block.max()) + 1
        cursor = i + n
    positions[:, cursor:] = torch.arange(next_pos, next_pos + len(token_ids) - cursor)
    next_pos += len(token_ids) - cursor
    for kind, left in (("image", grids), ("audio", counts), ("video", clips)):
        if next(left, None) is not None:
            raise InvalidRequest(f"the prompt has fewer {kind} placeholder runs than {kind} attachments")
    return PromptPositions(positions, next_pos - len(token_ids))


def _image_block(grid: tuple[int, int, int], merge: int, step: int) -> torch.Tensor:
    """`[3, t*h*w / merge^2]` offsets of one image's or video's tokens: temporal patch (`step` apart), merged row,
    merged col."""
    t, h, w = (int(x) for x in grid)
    h, w = h // merge, w // merge
    frame = frame_times(grid, merge, step).view(t, h, w)
    row = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    col = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([frame, row, col]).reshape(3, -1)


def _with_audio(frames: torch.Tensor, audio: int, cfg: ThinkerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A video's block `[3, n]` and its tokens with its sound track's `audio` tokens merged in, in time order (as
    `with_audio_tokens` lays them out)."""
    is_video = interleaved(frames[0], audio)
    block = torch.empty(3, len(is_video), dtype=torch.long)
    block[:, is_video] = frames
    block[:, ~is_video] = torch.arange(audio).expand(3, -1)
    return block, torch.where(is_video, cfg.video_token_id, cfg.audio_token_id)


def _take(it, kind: str):
    value = next(it, None)
    if value is None:
        raise InvalidRequest(f"the prompt has more {kind} placeholder runs than {kind} attachments")
    return value
