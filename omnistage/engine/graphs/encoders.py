"""CUDA graphs for the encoder towers: the audio encoder per bucket of attention windows, the vision encoder per
bucket of patches. Every host-derived piece of a call (chunk layout, segment boundaries, positions, which
output rows are real) is built outside the graph into static buffers; the graph is the towers' math alone.

Audio: a window is n_window_infer mel frames of one clip (8 s, 8 chunks of 100 frames, 104 tokens); nothing
crosses a window, so any batch of windows is encoded exactly as the eager tower does it, alone or in pieces.
A bucket of W windows holds 8W chunk slots, and the windows' chunks are packed into them one after another
(a 5 s clip takes 5, not a window's 8), then zero chunks. The convolutions' rows are reordered in the graph
(`order`): every window's real tokens first (a prefix of its chunks' rows: only a clip's last chunk is
short), then the rest. Each window is one attention segment, the padding rows others of at most 104, and the
unused segments are empty, so cu_seqlens has the fixed length 9W + 1 and padding never reaches a real token.
More windows than the largest bucket's chunks hold run as pieces of it. This layout follows Qwen3-Omni's AuT (Qwen3-ASR's tower is the same); a
tower of that shape is an `AudioTower`, whose own methods cut clips into windows and count their tokens.

Vision: a bucket of P patches holds up to `max_frames` images (frames) packed from row 0, then padding
patches (zero, in one segment of their own, last); the unused segments are empty. The learned positions and
the rotary cos, sin of each image are computed eagerly into static buffers. Real patches come first and
their count is a multiple of merge^2, so the merged rows of the images are the first rows of the output.
Larger images, or more frames, run eagerly.

Off CUDA, GraphSet binds static-eager calls over the same buffers, so this padding is tested on the CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol, cast

import numpy as np
import torch
from torch import nn

from omnistage.engine.buckets import decode_buckets
from omnistage.engine.graphs.base import GraphSet, size_of
from omnistage.models.layers.attention_metadata import to_device, to_device_together
from omnistage.models.layers.varlen_attention import Segments

# Windows in the largest audio graph (256 s of audio). Pieces of it are exact, and a call this large (3,328
# tokens through every layer, ~4 TFLOP at the released sizes) should be bound by its GPU work, not its
# launches, so a larger graph would only hold more memory (an estimate: no RESULTS.md row measures it yet).
MAX_AUDIO_WINDOWS = 32
# Chunks convolved at a time in an audio graph. A graph's pool keeps its scratch for good, and the first
# convolution's output and its GELU are most of it (480 x 64 x 50 bf16 each, ~6 MiB a chunk at the released
# sizes): 8 windows' chunks at a time keep the 32-window graph's to ~0.4 GiB where all at once take ~1.6 GiB.
GRAPH_CONV_CHUNKS = 64
# The largest vision graph: a 1920x1080 image (68 x 120 patches of 16 pixels, after the resize to multiples of 32).
MAX_VISION_PATCHES = 8192
# Images below 256 patches (256x256 pixels) take the 256-patch graph.
MIN_VISION_PATCHES = 256
# Images (frames) one vision graph call holds. Each segment, empty ones included, launches the attention
# kernel's blocks for the bucket's longest possible segment, so the count stays small; more go in further calls.
MAX_VISION_FRAMES = 8


class AudioWindow(Protocol):
    """One attention window of a clip: its first mel frame in the packed features, its frames and tokens."""

    @property
    def start(self) -> int: ...
    @property
    def frames(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class AudioSizes(Protocol):
    @property
    def num_mel_bins(self) -> int: ...
    @property
    def n_window(self) -> int: ...  # a chunk is 2 * n_window mel frames, convolved alone
    @property
    def n_window_infer(self) -> int: ...  # a window, whole chunks: its tokens attend only within it


class AudioTower(Protocol):
    """What AudioGraphs needs of an audio tower that encodes clips in windows of whole chunks, each window apart
    (Qwen3-Omni's AuT, its `AudioEncoder`, which Qwen3-ASR's tower is). How clips cut into windows and how many
    tokens frames give follow the tower's convolutions: the family's arithmetic, reached through the tower's
    methods, so that the engine names no family."""

    @property
    def cfg(self) -> AudioSizes: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def windows(self, frames: list[int]) -> Sequence[AudioWindow]: ...
    def output_tokens(self, frames: int) -> int: ...
    def gather_chunks(self, packed: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor: ...
    def conv_embed(self, chunks: torch.Tensor, group_size: int | None = None) -> torch.Tensor: ...
    def encode(self, x: torch.Tensor, segments: Segments) -> torch.Tensor: ...


class VisionSizes(Protocol):
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def spatial_merge_size(self) -> int: ...


class VisionTower(Protocol):
    """What VisionGraphs needs of a vision tower over packed patches (Qwen3-Omni's `VisionEncoder` is one): its
    grids and positions computed on the host side, its math (`encode`) in the graph. Its first parameter is
    the patch embedding's weight, whose rows are as wide as a patch."""

    @property
    def cfg(self) -> VisionSizes: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def grids(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]]: ...
    def positions(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def encode(
        self, pixel_values: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        segments: Segments,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...  # fmt: skip


def audio_buckets(max_windows: int) -> list[int]:
    """Window counts to capture: 1, 2, 4, 8, 16, 24, 32 (the decode ladder), up to the windows of the longest
    clip admitted or MAX_AUDIO_WINDOWS."""
    return decode_buckets(min(max_windows, MAX_AUDIO_WINDOWS))


def vision_buckets(max_patches: int, merge: int = 2) -> list[int]:
    """Patch counts to capture, 256, 384, 512, 768, ... (steps of at most a half), up to the largest image
    admitted or MAX_VISION_PATCHES; every one a multiple of merge^2, as every image's patch count is."""
    top = min(max_patches, MAX_VISION_PATCHES) // merge**2 * merge**2
    buckets = [b for b in decode_buckets(top) if b >= min(MIN_VISION_PATCHES, top)]
    return [b for b in buckets if b % merge**2 == 0]


class AudioGraphBuffers:
    """The audio tower's inputs for buckets of up to `max_windows` windows' worth of chunks (8 a window): a
    bucket of W holds 8W chunk slots, its windows' chunks packed from the first, then padding chunks."""

    def __init__(self, encoder: AudioTower, max_windows: int) -> None:
        cfg, weight = encoder.cfg, next(encoder.parameters())
        self.encoder, self.capacity = encoder, max_windows
        self.chunk = 2 * cfg.n_window
        self.chunks_per_window = cfg.n_window_infer // self.chunk
        self.chunk_tokens = encoder.output_tokens(self.chunk)
        self.window_tokens = self.chunks_per_window * self.chunk_tokens
        slots = max_windows * self.chunks_per_window
        self.chunks = torch.zeros(
            slots, cfg.num_mel_bins, self.chunk, dtype=weight.dtype, device=weight.device
        )
        # the convolutions' token rows in their order: every window's real rows, then the rest (padding)
        self.order = torch.zeros(slots * self.chunk_tokens, dtype=torch.int64, device=weight.device)
        # a segment per window, then the padding in segments of at most a window's tokens, then empty ones
        self.cu_seqlens = torch.zeros(self.segments(max_windows) + 1, dtype=torch.int32, device=weight.device)

    def segments(self, bucket: int) -> int:
        """The most segments a bucket's call has: a window of one chunk each, and its padding."""
        return bucket * self.chunks_per_window + bucket

    def args(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, Segments]:
        slots = bucket * self.chunks_per_window
        bounds = self.cu_seqlens[: self.segments(bucket) + 1]
        return (
            self.chunks[:slots],
            self.order[: slots * self.chunk_tokens],
            Segments.static(bounds, self.window_tokens),
        )

    def clear(self, bucket: int) -> None:
        """Every slot padding: zero chunks, the rows in their order, a window's tokens a segment."""
        slots = bucket * self.chunks_per_window
        self.chunks[:slots].zero_()
        rows = slots * self.chunk_tokens
        self.order[:rows].copy_(torch.arange(rows, device=self.order.device))
        bounds = torch.arange(self.segments(bucket) + 1, device=self.cu_seqlens.device) * self.window_tokens
        self.cu_seqlens[: self.segments(bucket) + 1].copy_(bounds.clamp(max=rows))

    def fill(self, packed: torch.Tensor, windows: Sequence[AudioWindow], bucket: int) -> int:
        """Lay the chunks of `windows` of packed features [mel, total] into the first slots and pad the rest of
        `bucket` (at most 8 * bucket chunks); returns how many real rows lead the output, in order."""
        starts, lengths, real = [], [], []
        slot = 0
        for window in windows:
            first = slot * self.chunk_tokens  # a window's real rows lead its chunks' (only its last is short)
            real.append(range(first, first + window.tokens))
            for start in range(window.start, window.start + window.frames, self.chunk):
                starts.append(start)
                lengths.append(min(self.chunk, window.start + window.frames - start))
                slot += 1
        slots = bucket * self.chunks_per_window
        if slot > slots:
            raise ValueError(f"{slot} chunks do not fit a bucket of {slots}")
        starts += [0] * (slots - slot)
        lengths += [0] * (slots - slot)
        rows = slots * self.chunk_tokens
        kept = np.concatenate([np.arange(r.start, r.stop) for r in real]) if real else np.zeros(0, np.int64)
        padding = np.ones(rows, dtype=bool)
        padding[kept] = False
        bounds = [0, *itertools.accumulate(len(r) for r in real)]
        bounds += range(bounds[-1] + self.window_tokens, rows, self.window_tokens)
        bounds += [rows] * (self.segments(bucket) + 1 - len(bounds))
        self.chunks[:slots].copy_(self.encoder.gather_chunks(packed, starts, lengths))
        order = torch.from_numpy(np.concatenate([kept, np.flatnonzero(padding)]))
        # every copy from the host pinned: a pageable one waits for the queued steps
        order, cu = to_device_together([order, torch.tensor(bounds, dtype=torch.int32)], packed.device)
        self.order[:rows].copy_(order)
        self.cu_seqlens[: len(bounds)].copy_(cu)
        return len(kept)


class AudioGraphs(GraphSet[AudioGraphBuffers]):
    """One graph of the audio tower per bucket of windows; `run` encodes clips in pieces of captured buckets."""

    kind = "audio encoder"
    unit = "windows"
    scaled_costs = False  # the convolutions run GRAPH_CONV_CHUNKS chunks at a time: scratch stops growing

    def __init__(self, encoder: AudioTower, max_windows: int, enforce_eager: bool = False) -> None:
        self.encoder = encoder
        device = next(encoder.parameters()).device
        super().__init__(self._step, AudioGraphBuffers(encoder, max_windows), device, enforce_eager)

    def _step(self, chunks: torch.Tensor, order: torch.Tensor, segments: Segments) -> torch.Tensor:
        tokens = self.encoder.conv_embed(chunks, GRAPH_CONV_CHUNKS).flatten(0, 1).index_select(0, order)
        return self.encoder.encode(tokens, segments)

    def run(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Clips' features [mel, frames_i] (on the tower's device) to their tokens [tokens_i, output_dim],
        as the eager tower gives them: every window through a captured graph, in pieces of the largest."""
        if not self.captured_buckets:
            raise RuntimeError("no audio encoder graph is captured")
        frames = [f.shape[-1] for f in features]
        packed = features[0] if len(features) == 1 else torch.cat(features, dim=-1)
        per_window = self.buffers.chunks_per_window
        room = size_of(self.captured_buckets[-1]) * per_window  # chunks in the largest bucket
        rows: list[torch.Tensor] = []
        for piece, chunks in self._pieces(self.encoder.windows(frames), room):
            bucket = cast(int, self.bucket_for(-(-chunks // per_window)))
            real = self.buffers.fill(packed, piece, bucket)
            rows.append(self.replay(bucket)[:real].clone())  # a copy: the next replay overwrites
        tokens = [self.encoder.output_tokens(n) for n in frames]
        return list((rows[0] if len(rows) == 1 else torch.cat(rows)).split(tokens))

    def _pieces(
        self, windows: Sequence[AudioWindow], room: int
    ) -> Iterator[tuple[Sequence[AudioWindow], int]]:
        """The windows in order, in pieces of at most `room` chunks, and each piece's chunks."""
        first, chunks = 0, 0
        for i, window in enumerate(windows):
            size = -(-window.frames // self.buffers.chunk)
            if chunks + size > room:
                yield windows[first:i], chunks
                first, chunks = i, 0
            chunks += size
        if chunks:
            yield windows[first:], chunks


class VisionGraphBuffers:
    """The vision tower's inputs for patch buckets `buckets`: patch rows shared (a bucket uses the first), and
    per bucket the segment boundaries (their last is the bucket's own size)."""

    def __init__(self, encoder: VisionTower, buckets: list[int], max_frames: int) -> None:
        cfg, weight = encoder.cfg, next(encoder.parameters())
        device, dtype = weight.device, weight.dtype
        self.encoder, self.max_frames = encoder, max_frames
        self.capacity = max(buckets)
        head_dim = cfg.hidden_size // cfg.num_heads
        self.pixels = torch.zeros(self.capacity, weight[0].numel(), dtype=dtype, device=device)
        self.positions = torch.zeros(self.capacity, cfg.hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(self.capacity, head_dim, dtype=torch.float32, device=device)
        self.sin = torch.zeros(self.capacity, head_dim, dtype=torch.float32, device=device)
        # max_frames image segments (empty when unused), then the padding's: [0, ..., 0, bucket] is all padding.
        self.cu_seqlens = {
            b: torch.tensor([0] * (max_frames + 1) + [b], dtype=torch.int32, device=device) for b in buckets
        }

    def args(self, bucket: int) -> tuple:
        rows = slice(0, bucket)
        segments = Segments.static(self.cu_seqlens[bucket], bucket)
        return self.pixels[rows], self.positions[rows], self.cos[rows], self.sin[rows], segments

    def clear(self, bucket: int) -> None:
        for buffer in (self.pixels, self.positions, self.cos, self.sin):
            buffer[:bucket].zero_()
        self.cu_seqlens[bucket][:-1].zero_()

    def fill(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]], bucket: int) -> None:
        """Images' patches into the first rows, their positions beside them, zero padding up to `bucket`."""
        patches = pixel_values.shape[0]
        positions, cos, sin = self.encoder.positions(grids, pixel_values.device)
        for buffer, real in ((self.pixels, pixel_values), (self.positions, positions), (self.cos, cos),
                             (self.sin, sin)):  # fmt: skip
            buffer[:patches].copy_(real)
            buffer[patches:bucket].zero_()
        bounds = [0, *itertools.accumulate(h * w for t, h, w in grids for _ in range(t))]  # a segment a frame
        bounds += [patches] * (self.max_frames + 1 - len(bounds)) + [bucket]
        self.cu_seqlens[bucket].copy_(to_device(torch.tensor(bounds, dtype=torch.int32), pixel_values.device))


class VisionGraphs(GraphSet[VisionGraphBuffers]):
    """One graph of the vision tower per patch bucket; `run` answers None for what no captured graph holds."""

    kind = "vision encoder"
    unit = "patches"
    scaled_costs = False  # attention within an image: its scratch is not in proportion to the patches

    def __init__(
        self,
        encoder: VisionTower,
        buckets: list[int],
        max_frames: int = MAX_VISION_FRAMES,
        enforce_eager: bool = False,
    ) -> None:
        merge = encoder.cfg.spatial_merge_size**2
        if any(b % merge for b in buckets):
            raise ValueError(f"vision buckets must be multiples of {merge} patches, got {buckets}")
        self.encoder = encoder
        buffers = VisionGraphBuffers(encoder, buckets, max_frames)
        super().__init__(encoder.encode, buffers, next(encoder.parameters()).device, enforce_eager)

    def run(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed patches of images to (embeds [n, out_hidden], deepstack [levels, n, out_hidden]) as the eager
        tower gives them, or None when they need more patches or frames than a captured graph holds."""
        grids = self.encoder.grids(pixel_values, grid_thw)
        patches = pixel_values.shape[0]
        bucket = self.bucket_for(patches) if patches else None
        if bucket is None or sum(t for t, _, _ in grids) > self.buffers.max_frames:
            return None
        merged, deepstack = self.replay(bucket, pixel_values, grids)
        rows = patches // self.encoder.cfg.spatial_merge_size**2
        return merged[:rows].clone(), torch.stack([level[:rows] for level in deepstack])
