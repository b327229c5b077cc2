"""How the encoder stage batches media for its towers and puts their rows back in prompt order.

A video goes through the vision tower in pieces of whole temporal patches, each within the stage's budget of
patches a call: the tower attends within a frame, so the pieces' rows are the rows of the whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnistage.models.multimodal import MultimodalInputs, PixelNorm


def vision_pieces(
    prompts: list[MultimodalInputs],
    budget: int,
    most_frames: int | None = None,
    eager_budget: int | None = None,
) -> tuple[list[torch.Tensor], list[tuple[int, int, int]], list[tuple[int, bool]]]:
    """The patches and grids of every image and video piece of `prompts`, and whose each is (prompt, is a
    video): images whole, videos in pieces of at most `budget` patches and `most_frames` temporal patches (at
    least one). A video whose frame is over `budget` (no graph holds it) goes in pieces of at most
    `eager_budget` patches instead: the eager tower's calls, fewer and larger (RESULTS.md, "Video with its
    sound: the vision tower per frame pair")."""
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    owners: list[tuple[int, bool]] = []
    for p, mm in enumerate(prompts):
        for values, grid_thw, is_video in (
            (mm.pixel_values, mm.image_grid_thw, False),
            (mm.pixel_values_videos, mm.video_grid_thw, True),
        ):
            if values is None or grid_thw is None:
                continue
            grid = [tuple(g) for g in grid_thw.tolist()]
            for patches, (t, h, w) in zip(values.split([math.prod(g) for g in grid]), grid):
                per = t  # temporal patches a piece
                if is_video and eager_budget is not None and h * w > budget:
                    per = max(1, eager_budget // (h * w))
                elif is_video:
                    per = max(1, min(budget // (h * w), most_frames or t))
                for first in range(0, t, per):
                    n = min(per, t - first)
                    pixels.append(patches[first * h * w : (first + n) * h * w])
                    grids.append((n, h, w))
                    owners.append((p, is_video))
    return pixels, grids, owners


def piece_norms(prompts: list[MultimodalInputs], owners: list[tuple[int, bool]]) -> list[PixelNorm | None]:
    """Each piece's normalisation (`vision_pieces`' owners): its prompt's for its kind."""
    return [prompts[p].video_norm if is_video else prompts[p].image_norm for p, is_video in owners]


def normalized(batch: torch.Tensor, norms: list[PixelNorm | None], sizes: list[int]) -> torch.Tensor:
    """A call's pieces `batch` (`sizes` patches each, in turn) as the tower's input: each piece's bytes through
    its `PixelNorm`, on the batch's device; pieces that come without one are the tower's input already."""
    if norms[0] is None:
        return batch
    if len(set(norms)) == 1:
        return norms[0](batch)
    return torch.cat(
        [norm(piece) if norm else piece for norm, piece in zip(norms, batch.split(sizes), strict=True)]
    )


@dataclass(frozen=True)
class VisionItem:
    """One image or video of a prompt: its key in the encoder cache, its patches and grid."""

    key: bytes
    is_video: bool
    patches: torch.Tensor
    grid: tuple[int, int, int]

    def alone(self, mm: MultimodalInputs) -> MultimodalInputs:
        """A prompt of this item alone, its patches normalised as in `mm`."""
        grid = torch.tensor([self.grid], dtype=torch.int64)
        if self.is_video:
            return MultimodalInputs([], [], None, None, [], self.patches, grid, video_norm=mm.video_norm)
        return MultimodalInputs([], [], self.patches, grid, [], image_norm=mm.image_norm)


def vision_items(mm: MultimodalInputs) -> list[VisionItem] | None:
    """A prompt's images, then its videos, each with its key; None where the keys are not all given."""
    items: list[VisionItem] = []
    for values, grid_thw, keys, is_video in (
        (mm.pixel_values, mm.image_grid_thw, mm.image_keys, False),
        (mm.pixel_values_videos, mm.video_grid_thw, mm.video_keys, True),
    ):
        if values is None or grid_thw is None:
            continue
        grids = [tuple(g) for g in grid_thw.tolist()]
        if len(keys) != len(grids):
            return None
        for key, patches, grid in zip(keys, values.split([math.prod(g) for g in grids]), grids):
            items.append(VisionItem(key, is_video, patches, grid))
    return items


@dataclass
class VisionRows:
    """A prompt's vision tower outputs: its images' rows and deepstack levels, and its videos'."""

    image: torch.Tensor | None = None  # [Ni, H]
    image_deepstack: torch.Tensor | None = None  # [levels, Ni, H]
    video: torch.Tensor | None = None  # [Nv, H]
    video_deepstack: torch.Tensor | None = None

    @classmethod
    def per_prompt(
        cls,
        rows: list[torch.Tensor],
        levels: list[torch.Tensor],
        owners: list[tuple[int, bool]],
        prompts: int,
    ) -> list[VisionRows]:
        """Each prompt's outputs from the pieces' `rows` and deepstack `levels`, owned as `vision_pieces` says."""
        out = []
        for p in range(prompts):
            joined: list[torch.Tensor | None] = []
            for video in (False, True):
                mine = [i for i, owner in enumerate(owners) if owner == (p, video)]
                joined += (
                    [join([rows[i] for i in mine], 0), join([levels[i] for i in mine], 1)]
                    if mine
                    else [None] * 2
                )
            out.append(cls(*joined))
        return out

    @classmethod
    def of_items(cls, items: list[tuple[bool, torch.Tensor, torch.Tensor]]) -> VisionRows:
        """A prompt's outputs from each of its images' and videos' (is a video, rows, deepstack levels), in the
        order `vision_items` gives them."""
        joined: list[torch.Tensor | None] = []
        for video in (False, True):
            mine = [(rows, levels) for is_video, rows, levels in items if is_video == video]
            joined += (
                [join([r for r, _ in mine], 0), join([levels for _, levels in mine], 1)]
                if mine
                else [None] * 2
            )
        return cls(*joined)

    def in_prompt_order(self, is_image: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows and levels of images and videos merged in the order of the prompt's vision rows
        (`is_image`: which of them are an image's)."""
        if self.video is None or self.video_deepstack is None:
            return self.image, self.image_deepstack
        if self.image is None or self.image_deepstack is None:
            return self.video, self.video_deepstack
        rows = self.image.new_empty(len(is_image), self.image.shape[1])
        levels = self.image_deepstack.new_empty(self.image_deepstack.shape[0], *rows.shape)
        mask = is_image.to(rows.device)
        rows[mask], rows[~mask] = self.image, self.video
        levels[:, mask], levels[:, ~mask] = self.image_deepstack, self.video_deepstack
        return rows, levels


def sees(mm: MultimodalInputs) -> bool:
    """Whether a prompt's media go through the vision tower."""
    return mm.pixel_values is not None or mm.pixel_values_videos is not None


def largest_inputs(max_prompt_tokens: int, tokens: int, max_images: int, videos: bool) -> int:
    """How many largest images' worth of vision rows (`tokens` each) one prompt may hold: as many images as the
    processor admits and the context holds; with videos, whatever the context holds, since a long video goes
    through the tower in pieces of at most one largest image each and keeps all their rows."""
    fit = max_prompt_tokens // tokens
    return max(1, fit if videos else min(max_images, fit))


def groups(
    sizes: list[int], budget: int, most: int | None = None, frames: list[int] | None = None
) -> list[list[int]]:
    """Consecutive indices of `sizes` in groups whose sum stays within `budget` (an item over it goes alone),
    of at most `most` frames (`frames` per item, default one each)."""
    frames = frames or [1] * len(sizes)
    groups: list[list[int]] = []
    total = count = 0
    for i, size in enumerate(sizes):
        if not groups or total + size > budget or (most is not None and count + frames[i] > most):
            groups.append([])
            total = count = 0
        groups[-1].append(i)
        total += size
        count += frames[i]
    return groups


def merged_rows(grid: tuple[int, int, int], merge: int) -> int:
    """The rows a vision tower gives an image of `grid` patches: one per merge x merge block of them."""
    return math.prod(grid) // merge**2


def join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`parts` concatenated along `dim`; a single part as it is, without a copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
