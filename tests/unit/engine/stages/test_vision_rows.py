"""How the encoder stage cuts videos into pieces and groups pieces into tower calls (pure bookkeeping)."""

from __future__ import annotations

import torch

from omnistage.engine.stages.vision_rows import VisionRows, groups, largest_inputs, normalized, vision_pieces
from omnistage.models.multimodal import MultimodalInputs, PixelNorm


def media(images: list[tuple[int, int, int]], videos: list[tuple[int, int, int]]) -> MultimodalInputs:
    def packed(grids):
        return (
            torch.arange(sum(t * h * w for t, h, w in grids), dtype=torch.float32)[:, None] if grids else None
        )

    return MultimodalInputs(
        audio_clips=[],
        num_audio_tokens=[],
        pixel_values=packed(images),
        image_grid_thw=torch.tensor(images) if images else None,
        num_image_tokens=[],
        pixel_values_videos=packed(videos),
        video_grid_thw=torch.tensor(videos) if videos else None,
    )


def test_a_video_is_cut_in_whole_temporal_patches_within_the_budget_and_the_frames():
    prompts = [media([(1, 4, 4)], [(5, 2, 4)]), media([], [(3, 2, 2)])]
    pixels, grids, owners = vision_pieces(prompts, budget=16)  # 16 patches: 2 temporal patches of 2x4
    assert grids == [(1, 4, 4), (2, 2, 4), (2, 2, 4), (1, 2, 4), (3, 2, 2)]
    assert owners == [(0, False), (0, True), (0, True), (0, True), (1, True)]
    # the pieces are the video's patches in order, none lost
    assert torch.equal(torch.cat(pixels[1:4]), prompts[0].pixel_values_videos)
    _, grids, _ = vision_pieces(prompts, budget=16, most_frames=1)
    assert grids == [(1, 4, 4)] + [(1, 2, 4)] * 5 + [(1, 2, 2)] * 3
    _, grids, _ = vision_pieces([media([], [(2, 8, 8)])], budget=16)  # a frame over the budget goes alone
    assert grids == [(1, 8, 8), (1, 8, 8)]


def test_a_video_no_graph_holds_goes_in_the_eager_towers_pieces():
    # frames of 64 patches, over the graphs' 16: pieces of the eager budget's 128 patches (2 temporal patches)
    prompts = [media([], [(5, 8, 8), (3, 2, 4)])]
    pixels, grids, _ = vision_pieces(prompts, budget=16, most_frames=1, eager_budget=128)
    assert grids == [(2, 8, 8), (2, 8, 8), (1, 8, 8)] + [(1, 2, 4)] * 3  # the second fits the graphs' pieces
    assert torch.equal(torch.cat(pixels), prompts[0].pixel_values_videos)
    _, grids, _ = vision_pieces(prompts, budget=16, eager_budget=32)  # a frame over both goes alone
    assert grids[:5] == [(1, 8, 8)] * 5


def test_groups_hold_the_budget_and_the_frames():
    assert groups([4, 4, 4, 9, 1], budget=8) == [[0, 1], [2], [3], [4]]
    assert groups([1, 1, 1, 1], budget=8, most=2) == [[0, 1], [2, 3]]
    assert groups([1, 1, 1, 1], budget=8, most=4, frames=[3, 1, 2, 2]) == [[0, 1], [2, 3]]


def test_rows_come_back_per_prompt_in_prompt_order():
    rows = [torch.full((2, 1), float(i)) for i in range(4)]
    levels = [r[None].expand(3, -1, -1) for r in rows]
    owners = [(0, False), (0, True), (1, True), (0, True)]
    first, second = VisionRows.per_prompt(rows, levels, owners, 2)
    assert first.image.flatten().tolist() == [0, 0] and first.video.flatten().tolist() == [1, 1, 3, 3]
    assert second.image is None and second.video.flatten().tolist() == [2, 2]
    # a prompt of image, video, image rows: `is_image` says which of its vision rows are an image's
    seen = VisionRows(
        torch.tensor([[0.0], [1.0]]), torch.zeros(3, 2, 1), torch.tensor([[9.0]]), torch.ones(3, 1, 1)
    )
    merged, deep = seen.in_prompt_order(torch.tensor([True, False, True]))
    assert merged.flatten().tolist() == [0, 9, 1] and deep[:, :, 0].tolist() == [[0, 1, 0]] * 3


def test_the_floor_holds_as_many_vision_rows_as_a_video_can_bring():
    # 8 images of 1,000 rows in a 32,768-token context; a video's pieces can fill the context: 32 of them
    assert largest_inputs(32_768, 1_000, 8, videos=False) == 8
    assert largest_inputs(32_768, 1_000, 8, videos=True) == 32
    assert largest_inputs(500, 1_000, 8, videos=True) == 1


def test_pieces_of_two_normalisations_each_get_their_own():
    """A call holding an image and a video piece whose processors normalise differently: each piece's floats
    are its bytes through its own `PixelNorm`, exactly; pieces without one pass as they are."""
    image = PixelNorm((127.5, 127.5, 127.5), (127.5, 127.5, 127.5))
    video = PixelNorm((122.4, 116.7, 104.1), (68.5, 66.6, 70.4))
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (7, 3 * 4), generator=generator, dtype=torch.uint8)
    out = normalized(batch, [image, video], [3, 4])
    assert out.dtype == torch.float32
    assert torch.equal(out[:3], image(batch[:3])) and torch.equal(out[3:], video(batch[3:]))
    assert not torch.equal(out[3:], image(batch[3:]))
    assert torch.equal(normalized(batch, [image, image], [3, 4]), image(batch))
    floats = torch.randn(7, 12)
    assert normalized(floats, [None, None], [3, 4]) is floats
    shift, scale = torch.tensor(video.shift)[:, None], torch.tensor(video.scale)[:, None]
    assert torch.equal(out[4].view(3, 4), (batch[4].view(3, 4).float() - shift) / scale)
