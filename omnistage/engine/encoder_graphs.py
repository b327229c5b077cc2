"""CUDA graphs for the encoder towers: the audio encoder per bucket of attention windows, the vision encoder per
bucket of patches. Every host-derived piece of a call (chunk layout, segment boundaries, positions, which
output rows are real) is built outside the graph into static buffers; the graph is the towers' math alone.

Audio: a window is n_window_infer mel frames of one clip (8 s, 8 chunks, 104 tokens); nothing crosses a
window, so any batch of windows is encoded exactly as the eager tower does it, alone or in pieces. A bucket
of W windows holds W window slots of 8 zero-padded chunks each. Each slot's real tokens are a prefix of its
104 token rows (only a clip's last chunk is short, and it ends its window): the slot is two attention
segments, its real tokens and its padding (empty for a full window; a padding slot is all padding), so
cu_seqlens has the fixed length 2W + 1 and padding never reaches a real token. More windows than the
largest bucket run as pieces of it.

Vision: a bucket of P patches holds up to `max_frames` images (frames) packed from row 0, then padding
patches (zero, in one segment of their own, last); the unused segments are empty. The learned positions and
the rotary cos, sin of each image are computed eagerly into static buffers. Real patches come first and
their count is a multiple of merge^2, so the merged rows of the images are the first rows of the output.
Larger images, or more frames, run eagerly.

Off CUDA, GraphSet binds static-eager calls over the same buffers, so this padding is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnistage.engine.buckets import decode_buckets
from omnistage.engine.gpu_memory import Peak, device_peak
from omnistage.engine.graphs import GraphSet
from omnistage.models.layers.varlen_attention import Segments
from omnistage.models.qwen3_omni.audio_encoder import (
    AudioEncoder,
    AudioWindow,
    audio_output_tokens,
    audio_windows,
    gather_chunks,
)
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder, frame_bounds

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
    """The audio tower's inputs for up to `max_windows` window slots; a bucket uses the first slots."""

    def __init__(self, encoder: AudioEncoder, max_windows: int) -> None:
        cfg, weight = encoder.cfg, encoder.conv2d1.weight
        self.capacity = max_windows
        self.chunk = 2 * cfg.n_window
        self.chunks_per_window = cfg.n_window_infer // self.chunk
        self.window_tokens = self.chunks_per_window * audio_output_tokens(self.chunk, cfg.n_window)
        slots = max_windows * self.chunks_per_window
        self.chunks = torch.zeros(
            slots, cfg.num_mel_bins, self.chunk, dtype=weight.dtype, device=weight.device
        )
        # Window slot s is segments [s*T, s*T + real) and [s*T + real, (s+1)*T).
        self.cu_seqlens = torch.zeros(2 * max_windows + 1, dtype=torch.int32, device=weight.device)

    def args(self, bucket: int) -> tuple[torch.Tensor, Segments]:
        chunks = self.chunks[: bucket * self.chunks_per_window]
        return chunks, Segments.static(self.cu_seqlens[: 2 * bucket + 1], self.window_tokens)

    def clear(self, bucket: int) -> None:
        """Every slot padding: zero chunks, each slot's tokens one segment."""
        self.chunks[: bucket * self.chunks_per_window].zero_()
        slot = torch.arange(2 * bucket + 1, dtype=torch.int32, device=self.cu_seqlens.device) // 2
        self.cu_seqlens[: 2 * bucket + 1].copy_(slot * self.window_tokens)

    def fill(self, packed: torch.Tensor, windows: list[AudioWindow], bucket: int) -> torch.Tensor:
        """Lay `windows` of packed features [mel, total] into the first slots and pad the rest of `bucket`;
        returns the output rows of their real tokens, in order (on the device)."""
        starts, lengths, bounds = [], [], [0]
        rows: list[int] = []
        for slot in range(bucket):
            window = windows[slot] if slot < len(windows) else AudioWindow(0, 0, 0)
            for c in range(self.chunks_per_window):
                frames = min(self.chunk, max(0, window.frames - c * self.chunk))
                starts.append(window.start + c * self.chunk if frames else 0)
                lengths.append(frames)
            first = slot * self.window_tokens
            bounds += [first + window.tokens, first + self.window_tokens]
            rows += range(first, first + window.tokens)
        self.chunks[: bucket * self.chunks_per_window].copy_(
            gather_chunks(packed, starts, lengths, self.chunk)
        )
        self.cu_seqlens[: 2 * bucket + 1].copy_(torch.tensor(bounds, dtype=torch.int32))
        return torch.tensor(rows, device=packed.device)


class AudioGraphs(GraphSet):
    """One graph of the audio tower per bucket of windows; `run` encodes clips in pieces of captured buckets."""

    kind = "audio encoder"
    unit = "windows"

    def __init__(self, encoder: AudioEncoder, max_windows: int, enforce_eager: bool = False) -> None:
        self.encoder = encoder
        device = encoder.conv2d1.weight.device
        super().__init__(self._step, AudioGraphBuffers(encoder, max_windows), device, enforce_eager)

    def _step(self, chunks: torch.Tensor, segments: Segments) -> torch.Tensor:
        tokens = self.encoder.conv_embed(chunks, GRAPH_CONV_CHUNKS).flatten(0, 1)
        return self.encoder.encode(tokens, segments)

    def run(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Clips' features [mel, frames_i] (on the tower's device) to their tokens [tokens_i, output_dim],
        as the eager tower gives them: every window through a captured graph, in pieces of the largest."""
        if not self.captured_buckets:
            raise RuntimeError("no audio encoder graph is captured")
        cfg = self.encoder.cfg
        frames = [f.shape[-1] for f in features]
        packed = features[0] if len(features) == 1 else torch.cat(features, dim=-1)
        windows = audio_windows(frames, cfg.n_window, cfg.n_window_infer)
        largest = self.captured_buckets[-1]
        rows = []
        for first in range(0, len(windows), largest):
            piece = windows[first : first + largest]
            bucket = self.bucket_for(len(piece))
            assert bucket is not None  # a piece is at most the largest captured bucket
            real = self.buffers.fill(packed, piece, bucket)
            self._replays[bucket]()
            rows.append(self._outputs[bucket].index_select(0, real))  # a copy: the next replay overwrites
        tokens = [audio_output_tokens(n, cfg.n_window) for n in frames]
        return list((rows[0] if len(rows) == 1 else torch.cat(rows)).split(tokens))


class VisionGraphBuffers:
    """The vision tower's inputs for patch buckets `buckets`: patch rows shared (a bucket uses the first), and
    per bucket the segment boundaries (their last is the bucket's own size)."""

    def __init__(self, encoder: VisionEncoder, buckets: list[int], max_frames: int) -> None:
        cfg, weight = encoder.cfg, encoder.patch_embed.proj.weight
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
        bounds = frame_bounds(grids)
        bounds += [patches] * (self.max_frames + 1 - len(bounds)) + [bucket]
        self.cu_seqlens[bucket].copy_(torch.tensor(bounds, dtype=torch.int32))


class VisionGraphs(GraphSet):
    """One graph of the vision tower per patch bucket; `run` answers None for what no captured graph holds."""

    kind = "vision encoder"
    unit = "patches"

    def __init__(
        self,
        encoder: VisionEncoder,
        buckets: list[int],
        max_frames: int = MAX_VISION_FRAMES,
        enforce_eager: bool = False,
    ) -> None:
        merge = encoder.cfg.spatial_merge_size**2
        if any(b % merge for b in buckets):
            raise ValueError(f"vision buckets must be multiples of {merge} patches, got {buckets}")
        self.encoder = encoder
        buffers = VisionGraphBuffers(encoder, buckets, max_frames)
        super().__init__(encoder.encode, buffers, encoder.patch_embed.proj.weight.device, enforce_eager)

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
        self.buffers.fill(pixel_values, grids, bucket)
        self._replays[bucket]()
        merged, deepstack = self._outputs[bucket]
        rows = patches // self.encoder.cfg.spatial_merge_size**2
        return merged[:rows].clone(), torch.stack([level[:rows] for level in deepstack])


def graph_peaks(make: Callable[[int], GraphSet], buckets: list[int], device: torch.device) -> dict[int, Peak]:
    """What a graph of each bucket takes, measured (GPU only): the eager peak of the bucket's step on a graph
    set made for that bucket alone (`make(bucket)`), and what it keeps (its static buffers and outputs)."""
    peaks = {}
    for bucket in buckets:
        with torch.inference_mode(), device_peak(device) as peak:
            graphs = make(bucket)
            graphs.buffers.clear(bucket)
            out = graphs.step(*graphs.buffers.args(bucket))
        del graphs, out
        torch.cuda.empty_cache()
        peaks[bucket] = peak
    return peaks
