"""The Thinker's 3-stream M-RoPE positions (temporal, height, width) for a prompt of text, audio and images.

The rules of transformers' `get_rope_index` for Qwen3-Omni: a text token takes the next position in all
three streams; an audio clip's tokens do too (audio is 1-D, so an audio-only prompt is plain 0..L-1); an
image's tokens start at the next position s and lie on its merged grid, (s + t * position_id_per_seconds,
s + row, s + col); whatever follows a block starts one past the block's largest position. A generated token
at sequence index p >= L then sits at p + delta in all three streams, delta = (largest position + 1) - L.
"""

from __future__ import annotations

import torch

from omnistage.errors import InvalidRequest
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import ThinkerConfig


def rope_positions(
    token_ids: list[int],
    image_grids: list[tuple[int, int, int]],
    audio_token_counts: list[int],
    cfg: ThinkerConfig,
) -> PromptPositions:
    """Positions `[3, L]` of an expanded prompt; its placeholder runs must match the grids and counts, in order."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    placeholders = torch.tensor([cfg.audio_token_id, cfg.image_token_id, cfg.video_token_id])
    positions = torch.empty(3, len(token_ids), dtype=torch.long)
    grids, counts = iter(image_grids), iter(audio_token_counts)
    cursor = next_pos = 0  # next token to place, and the position it takes if it is text
    for i in torch.isin(ids, placeholders).nonzero().flatten().tolist():
        if i < cursor:  # inside a block already placed
            continue
        positions[:, cursor:i] = torch.arange(next_pos, next_pos + i - cursor)
        next_pos += i - cursor
        token = token_ids[i]
        if token == cfg.image_token_id:
            block = _image_block(
                _take(grids, "image"), cfg.vision.spatial_merge_size, cfg.position_id_per_seconds
            )
        elif token == cfg.audio_token_id:
            block = torch.arange(_take(counts, "audio")).expand(3, -1)
        else:
            raise InvalidRequest("video placeholders are not supported")
        n = block.shape[1]
        if n == 0 or token_ids[i : i + n] != [token] * n:
            kind = "image" if token == cfg.image_token_id else "audio"
            raise InvalidRequest(
                f"the {kind} placeholder run at token {i} does not hold the {n} tokens its media gives"
            )
        positions[:, i : i + n] = block + next_pos
        next_pos += int(block.max()) + 1
        cursor = i + n
    positions[:, cursor:] = torch.arange(next_pos, next_pos + len(token_ids) - cursor)
    next_pos += len(token_ids) - cursor
    for kind, left in (("image", grids), ("audio", counts)):
        if next(left, None) is not None:
            raise InvalidRequest(f"the prompt has fewer {kind} placeholder runs than {kind} attachments")
    return PromptPositions(positions, next_pos - len(token_ids))


def _image_block(grid: tuple[int, int, int], merge: int, per_second: int) -> torch.Tensor:
    """`[3, t*h*w / merge^2]` offsets of one image's tokens: frame (a 1 s step each), merged row, merged col."""
    t, h, w = (int(x) for x in grid)
    h, w = h // merge, w // merge
    frame = (torch.arange(t) * per_second).view(-1, 1, 1).expand(t, h, w)
    row = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    col = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([frame, row, col]).reshape(3, -1)


def _take(it, kind: str):
    value = next(it, None)
    if value is None:
        raise InvalidRequest(f"the prompt has more {kind} placeholder runs than {kind} attachments")
    return value
