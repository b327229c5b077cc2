"""The Qwen3-Omni vision encoder: image patches to thinker-sized visual tokens plus deepstack features.

Patches (already in merge-block order, see image_processing.py) are embedded by a Conv3d applied as one
matmul, get a learned position table bilinearly resampled to each image's grid and a 2-D rotary
embedding, and run through ViT blocks attending within each image (cu_seqlens over a ragged batch).
The merger folds each 2x2 block of patches into one thinker token; the deepstack mergers do the same to
the outputs of the blocks listed in deepstack_visual_indexes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.activations import ACTIVATIONS
from omnistage.models.layers.varlen_attention import Segments, varlen_attention
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig, VisionEncoderConfig

PREFIX = "thinker.visual."
ROPE_THETA = 10000.0  # the released vision config's axial rope_theta


def frame_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
    """Attention segment boundaries over packed patches: each frame of each image attends within itself."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def merge_block_coords(h: int, w: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of an h x w grid, in merge-block order (the order of the patches)."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _axis_taps(coord: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1) and weights into a `side`-long table for `size` points, corners aligned."""
    src = coord.float() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    lo = lo.long()
    return torch.stack([lo, (lo + 1).clamp(max=side - 1)], -1), torch.stack([1 - frac, frac], -1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A Conv3d whose stride equals its kernel over one patch each is a matmul over the flat patch.
        weight = self.proj.weight.view(self.proj.out_channels, -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    """The attention's projections; the block runs them around the varlen kernel (`VisionBlock.queries`,
    `VisionBlock.finish`)."""

    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32, halves rotated against each other; cos/sin [tokens, head_dim]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: Segments | list[int]
    ) -> torch.Tensor:
        q, k, v = self.queries(x, cos, sin)
        return self.finish(x, varlen_attention(q, k, v, cu_seqlens))

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (rotated) and v [tokens, heads, head_dim] of the normed input: the block up to its attention."""
        attn = self.attn
        q, k, v = attn.qkv(self.norm1(x)).view(x.shape[0], 3, attn.num_heads, -1).unbind(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The block after its attention: the output projection, both residuals and the MLP."""
        x = x + self.attn.proj(attended.reshape(x.shape[0], -1))
        return x + self.mlp(self.norm2(x))

    def compile_regions(self, **kwargs: Any) -> None:
        """torch.compile the two regions around the attention (`queries`, `finish`) with `kwargs`: their
        norms, rotary, residuals and activation fuse, while the attention, whose segments are host ints,
        stays the one varlen kernel call between them. The math is the eager block's."""
        self.queries = torch.compile(self.queries, **kwargs)  # type: ignore[method-assign]
        self.finish = torch.compile(self.finish, **kwargs)  # type: ignore[method-assign]


class PatchMerger(nn.Module):
    """merge x merge patches -> one token: LayerNorm (per patch, or over the block when post-shuffle), MLP."""

    def __init__(self, cfg: VisionEncoderConfig, postshuffle_norm: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = nn.LayerNorm(self.width if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        out = cfg.out_hidden_size
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.view(-1, self.width)) if self.postshuffle_norm else self.ln_q(x).view(-1, self.width)
        return self.mlp(x)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported")
        self.cfg = cfg
        self.side = round(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Packed patches [sum t*h*w, C*T*P*P] of images with grids (t, h, w) to
        (embeds [sum t*h*w / merge^2, out_hidden], one such tensor per deepstack level)."""
        grids = self.grids(pixel_values, grid_thw)
        positions, cos, sin = self.positions(grids, pixel_values.device)
        segments = Segments.of(frame_bounds(grids), pixel_values.device)
        return self.encode(pixel_values, positions, cos, sin, segments)

    def compile_regions(self) -> None:
        """torch.compile every block's regions around its attention and the mergers, for any patch count
        (`dynamic`): the glue between the GEMMs and the attention (LayerNorms, the float32 rotary, residuals,
        GELU) is most of an eager call's kernels. One compiled graph serves all the blocks alike."""
        for block in self.blocks:
            assert isinstance(block, VisionBlock)
            block.compile_regions(dynamic=True)
        for merger in (self.merger, *self.merger_list):
            merger.compile(dynamic=True)

    def grids(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]]:
        """The images' grids as host ints, checked against the patches and the merge size."""
        grid_thw = grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != total:
            raise ValueError(f"pixel_values hold {pixel_values.shape[0]} patches, grid_thw says {total}")
        m = self.cfg.spatial_merge_size
        if any(h % m or w % m for _, h, w in grids):
            raise ValueError(f"every grid side must be a multiple of spatial_merge_size {m}: {grids}")
        return grids

    def encode(
        self,
        pixel_values: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Segments,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches, their learned positions and rotary cos, sin (from `positions`) through the blocks, attending
        within `segments`, to (merged embeds, deepstack levels): the math alone, no per-image host work (a
        CUDA graph of static buffers runs it)."""
        x = self.patch_embed(pixel_values) + positions.to(self.patch_embed.proj.weight.dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

    def positions(
        self, grids: list[tuple[int, int, int]], device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Interpolated learned positions [patches, hidden] and rotary cos, sin [patches, head_dim]."""
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / ROPE_THETA ** (quarter / (head_dim // 2))
        table = self.pos_embed.weight
        learned: list[torch.Tensor] = []
        angles: list[torch.Tensor] = []
        for t, h, w in grids:
            rows, cols = merge_block_coords(h, w, self.cfg.spatial_merge_size, device)
            row_taps, row_weights = _axis_taps(rows, h, self.side)
            col_taps, col_weights = _axis_taps(cols, w, self.side)
            index = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).flatten(1)  # [patches, 4]
            weight = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
            learned.append((table[index] * weight[..., None]).sum(1).repeat(t, 1))
            # [patches, head_dim / 2]: row angles then column angles, the same frequencies on both axes.
            freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
            angles.append(freqs.repeat(t, 1))
        half = torch.cat(angles)
        full = torch.cat([half, half], dim=-1)
        return torch.cat(learned), full.cos(), full.sin()


def load_vision_encoder(checkpoint_dir: str | Path, options: LoadOptions) -> VisionEncoder:
    """The vision encoder of a Qwen3-Omni checkpoint directory, weights read by their file names."""
    cfg = Qwen3OmniConfig.from_dir(checkpoint_dir).thinker.vision
    return load_model(lambda: VisionEncoder(cfg), checkpoint_dir, PREFIX, options)
