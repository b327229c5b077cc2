"""The vision tower's compiled regions (`VisionEncoder.compile_regions`, what a GPU server runs): the blocks'
math around the attention, traced once for all the blocks, gives the eager tower's rows."""

import dataclasses
import functools

import torch
from torch._dynamo.utils import counters

from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.tiny import released_config
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder


def test_compiled_regions_give_the_eager_rows_with_one_graph_for_every_block(monkeypatch):
    cfg = Qwen3OmniConfig.from_dict(released_config()).thinker.vision
    small = dataclasses.replace(
        cfg,
        hidden_size=64,
        num_heads=4,
        intermediate_size=96,
        depth=6,
        out_hidden_size=32,
        deepstack_visual_indexes=(1, 3, 5),
    )
    torch.manual_seed(0)
    tower = VisionEncoder(small).eval()
    width = tower.patch_embed.proj.weight[0].numel()
    grids = [(2, 8, 8), (1, 4, 6)]  # two images: two attention segments, one call
    x = torch.randn(sum(t * h * w for t, h, w in grids), width)
    with torch.inference_mode():
        want_rows, want_levels = tower(x, grids)
        # dynamo's tracing without inductor's code generation (no C++ compiler on every CPU machine)
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        torch._dynamo.reset()
        counters.clear()
        tower.compile_regions()
        rows, levels = tower(x, grids)
    # queries, finish and the two kinds of merger: one graph each, though six blocks and four mergers ran
    assert counters["stats"]["unique_graphs"] == 4
    torch.testing.assert_close(rows, want_rows)
    for got, want in zip(levels, want_levels, strict=True):
        torch.testing.assert_close(got, want)
