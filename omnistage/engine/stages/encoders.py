"""The encoder stage: audio and vision towers turning prompts' media into embedding rows.

Runs at admission, once for all the requests admitted together: the clips of every prompt go through
the audio tower as ragged batches and the images and videos through the vision tower (a request's rows depend
on its neighbours only in their last bits), each call holding at most the largest single image the processor
admits: the input the memory plan measures the towers on. A clip seen before takes the rows kept for it on the
host (encoder_cache.py): the same clip gives the same rows bit for bit, and the prefix cache hits through it.
A video goes in pieces of whole temporal patches within that bound (the tower attends within a frame, so the
pieces give the rows the whole would). The outputs replace the prompts' placeholder embeddings during prefill
(see ModelRunner) and, for images and videos, feed the deepstack levels.

With CUDA graphs captured (`capture_graphs`, see graphs/encoders.py) the clips go through the audio graphs in
pieces of windows, and the images through the vision graphs in calls of at most the largest patch bucket;
an image larger than that runs eagerly.

The stage names no family: a family's pipeline hands it its towers (`EagerAudioTower`, `EagerVisionTower`) and
how its processor lays out clips, images and videos for them (`encoder_formats.py`); Qwen3-Omni's are built in
pipeline/qwen3_omni_encoders.py.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from omnistage.engine.graphs.base import Bucket, graph_peaks, int_buckets
from omnistage.engine.graphs.encoders import (
    AudioGraphs,
    VisionGraphs,
    audio_buckets,
    vision_buckets,
)
from omnistage.engine.memory.floor import Floor
from omnistage.engine.memory.measure import Peak, device_peak
from omnistage.engine.stages.encoder_cache import EncoderCache
from omnistage.engine.stages.encoder_formats import (
    AudioFormat,
    EagerAudioTower,
    EagerVisionTower,
    ImageFormat,
    VideoFormat,
)
from omnistage.engine.stages.host_rows import HostRows
from omnistage.engine.stages.vision_rows import (
    VisionRows,
    groups,
    join,
    largest_inputs,
    merged_rows,
    normalized,
    piece_norms,
    sees,
    vision_items,
    vision_pieces,
)
from omnistage.errors import InvalidRequest
from omnistage.models.layers.attention_metadata import cat_to_device, to_device_together
from omnistage.models.multimodal import MultimodalInputs

log = logging.getLogger(__name__)


@dataclass
class MultimodalEmbeds:
    """Encoder outputs of one prompt: the prompt rows they replace, and the deepstack levels of the vision rows."""

    audio_rows: torch.Tensor  # long [Na] prompt positions of audio placeholders, ascending, on the device
    audio_embeds: torch.Tensor | None  # [Na, H]
    image_rows: torch.Tensor  # long [Ni] the vision tower's rows: image and video placeholders, ascending
    image_embeds: torch.Tensor | None  # [Ni, H]
    deepstack: torch.Tensor | None  # [levels, Ni, H]
    # the rows on the host: a prompt chunk finds its share of them without waiting for the device
    audio_rows_host: np.ndarray
    image_rows_host: np.ndarray
    # audio_embeds and image_embeds on the host for the prefix keys, copied without waiting (host_rows.py)
    host_rows: HostRows | None = None
    # audio_embeds, image_embeds and deepstack on the host while they are off the device (media_hold.py)
    offloaded: tuple[torch.Tensor | None, ...] | None = None


class EncoderStage:
    name = "encoders"  # its section of the config's stages (`stages.encoders`)

    def __init__(
        self,
        audio_encoder: EagerAudioTower,
        audio: AudioFormat,
        device: torch.device,
        vision_encoder: EagerVisionTower | None = None,
        images: ImageFormat | None = None,
        videos: VideoFormat | None = None,
        cache_bytes: int = 0,
    ) -> None:
        """The towers a family loaded and the layout of their inputs; no vision tower: audio only. The clips'
        rows are kept on the host up to `cache_bytes` (encoder_cache.py; 0: none)."""
        if (vision_encoder is None) != (images is None):
            raise ValueError("a vision tower comes with its image format, and an image format with its tower")
        if videos is not None and images is None:
            raise ValueError("videos go through the vision tower: a video format needs an image format")
        self.audio_encoder, self.vision_encoder = audio_encoder, vision_encoder
        self.audio, self.images, self.videos, self.device = audio, images, videos, device
        # The largest inputs the processor admits, and the most one tower call takes.
        self.max_audio_frames = audio.max_frames
        self.max_image_patches = math.prod(images.largest_grid) if images is not None else 0
        # A video's eager calls where no graph holds its frames: a quarter of the largest image, whose eager
        # call the floor measured; a quarter of its peak, and per frame pair within 6% of the largest call's
        # time (RESULTS.md, "Video with its sound: the vision tower per frame pair").
        self.max_video_patches = self.max_image_patches // 4
        self.audio_graphs: AudioGraphs | None = None
        self.vision_graphs: VisionGraphs | None = None
        self.cache = EncoderCache(cache_bytes)
        self.rows_limit: int | None = (
            None  # the rows a text stage holds at once (`profile_floor`, media_hold.py)
        )

    def encode(self, token_ids: list[int], mm: MultimodalInputs) -> MultimodalEmbeds:
        """Run the audio and vision encoders for one prompt; their rows must match its placeholders."""
        return self.encode_many([(token_ids, mm)])[0]

    @torch.inference_mode()
    def encode_many(
        self, prompts: list[tuple[list[int], MultimodalInputs]], cached: bool = True
    ) -> list[MultimodalEmbeds]:
        """The encoders over several prompts' media, in ragged batches of at most the largest input; per
        prompt, in order. A clip seen before takes its kept rows unless not `cached`.

        Raises InvalidRequest when a prompt's placeholders and its media disagree (the caller retries the
        prompts one by one to fail only that one).
        """
        clips = [c for _, mm in prompts for c in mm.audio_clips]
        keys = [k for _, mm in prompts for k in mm.audio_keys]
        audio = iter(
            self._clip_rows(clips, keys) if cached and self.cache.enabled else self._encode_clips(clips)
        )
        seeing = [mm for _, mm in prompts if sees(mm)]
        vision = iter(self._vision_rows(seeing, cached) if seeing else [])
        out = []
        for token_ids, mm in prompts:
            clip_rows = [next(audio) for _ in mm.audio_clips]
            seen = next(vision) if sees(mm) else VisionRows()
            out.append(self._place(token_ids, join(clip_rows, 0) if clip_rows else None, seen))
        return out

    def _clip_rows(self, clips: list[torch.Tensor], keys: list[bytes]) -> list[torch.Tensor]:
        """Each clip's rows on the device: those kept from an earlier call (`self.cache`, by the processor's
        `clip_digest`) copied to the device without waiting, the others (each distinct clip once) through the
        tower, then kept (copied to the host without waiting: encoder_cache.py)."""
        if len(keys) != len(clips):
            raise ValueError(f"{len(clips)} clips came with {len(keys)} keys (MultimodalInputs.audio_keys)")
        found = {k: kept for k in dict.fromkeys(keys) if (kept := self.cache.get(k)) is not None}
        fresh = {k: f for k, f in zip(keys, clips) if k not in found}
        self.cache.hits += len(clips) - len(fresh)
        self.cache.misses += len(fresh)
        rows = {k: r.to(self.device, non_blocking=True, copy=True) for k, r in found.items()}
        rows |= dict(zip(fresh, self._encode_clips(list(fresh.values()))))
        for k in fresh:
            self.cache.put(k, rows[k])
        return [rows[k] for k in keys]

    def _encode_clips(self, clips: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tower's rows of each clip (a waveform on the host), in calls of at most `max_audio_frames` (with
        graphs, each call in pieces of the largest audio bucket), each call's features made together on the
        device (`AudioFormat.features`: one copy of the samples and a few kernels, queued behind the step in
        flight without waiting for it)."""
        rows: list[torch.Tensor] = []
        tower = self.audio_graphs.run if self.audio_graphs is not None else self.audio_encoder
        frames = [clip.numel() // self.audio.hop_length for clip in clips]
        for group in groups(frames, self.max_audio_frames):
            rows += tower(self.audio.features([clips[i] for i in group], self.device))
        return rows

    def _vision_rows(self, prompts: list[MultimodalInputs], cached: bool) -> list[VisionRows]:
        """Per prompt, the rows and deepstack levels of its images and of its videos: those kept from an earlier
        call (`self.cache`, by the processor's `patches_digest`) copied to the device without waiting, the
        others (each distinct image or video once) through the tower, then kept, as `_clip_rows` does clips.
        Where the cache is off or a prompt's keys are not all given, every one goes through the tower."""
        items = [vision_items(mm) for mm in prompts]
        if not (cached and self.cache.enabled) or any(mine is None for mine in items):
            return self._encode_vision(prompts)
        every = [(p, item) for p, mine in enumerate(items) for item in mine or ()]
        found = {i.key: kept for _, i in every if (kept := self.cache.get(i.key)) is not None}
        fresh: dict[bytes, MultimodalInputs] = {}
        for p, item in every:
            if item.key not in found:
                fresh.setdefault(item.key, item.alone(prompts[p]))
        self.cache.hits += len(every) - len(fresh)
        self.cache.misses += len(fresh)
        merge = self.images.spatial_merge_size if self.images is not None else 1
        outputs: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        for _, item in every:
            if item.key in found and item.key not in outputs:
                kept = found[item.key].to(self.device, non_blocking=True, copy=True)
                count = merged_rows(item.grid, merge)
                outputs[item.key] = kept[:count], kept[count:].view(-1, count, kept.shape[1])
        for key, seen in zip(fresh, self._encode_vision(list(fresh.values())), strict=True):
            rows, levels = (
                (seen.video, seen.video_deepstack)
                if seen.video is not None
                else (seen.image, seen.image_deepstack)
            )
            assert rows is not None and levels is not None
            outputs[key] = rows, levels
            self.cache.put(key, [rows, levels])
        return [VisionRows.of_items([(i.is_video, *outputs[i.key]) for i in mine or ()]) for mine in items]

    def _encode_vision(self, prompts: list[MultimodalInputs]) -> list[VisionRows]:
        """Per prompt, the rows [n, H] and deepstack levels [levels, n, H] of its images and of its videos; they
        go through the tower in calls of at most `max_image_patches` (with graphs, of at most the largest patch
        bucket and as many frames as its graph holds), a video in pieces of whole temporal patches; a video whose
        frame no graph holds in eager calls of at most `max_video_patches`."""
        assert self.images is not None and self.vision_encoder is not None  # images reach only a vision stage
        merge = self.images.spatial_merge_size
        graphs = self.vision_graphs
        budget, most = self.max_image_patches, None
        if graphs is not None:
            budget, most = int_buckets(graphs.captured_buckets)[-1], graphs.buffers.max_frames
        pixels, grids, owners = vision_pieces(prompts, budget, most, self.max_video_patches)
        norms = piece_norms(prompts, owners)
        rows, levels = [], []
        for group in groups([len(x) for x in pixels], budget, most, [t for t, _, _ in grids]):
            batch = cat_to_device([pixels[i] for i in group], self.device)  # bytes: a quarter of the floats
            batch = normalized(batch, [norms[i] for i in group], [len(pixels[i]) for i in group])
            group_grids = [grids[i] for i in group]
            out = graphs.run(batch, group_grids) if graphs is not None else None
            if out is None:
                embeds, deepstack = self.vision_encoder(batch, group_grids)
                out = embeds, torch.stack(deepstack)
            sizes = [merged_rows(g, merge) for g in group_grids]
            rows += out[0].split(sizes)
            levels += out[1].split(sizes, dim=1)
        return VisionRows.per_prompt(rows, levels, owners, len(prompts))

    @property
    def max_audio_windows(self) -> int:
        """Attention windows of the longest clip admitted."""
        return -(-self.max_audio_frames // self.audio_encoder.cfg.n_window_infer)

    def default_graph_buckets(self) -> tuple[list[int], list[int]]:
        """The audio window buckets and vision patch buckets to capture unless configured (graphs/encoders.py)."""
        audio = audio_buckets(self.max_audio_windows)
        if self.images is None:
            return audio, []
        return audio, vision_buckets(self.max_image_patches, self.images.spatial_merge_size)

    def graph_costs(self, audio: list[int], vision: list[int]) -> dict[str, dict[Bucket, Peak]]:
        """Per tower ("audio", "vision") and bucket, the measured eager peak of its padded step and what the
        step keeps (its rows and static buffers; GPU only, before capture): graphs of one pool share the
        rest, their scratch (memory.plan.GraphCandidates). The sets are made at capture, so each bucket's is
        measured on a set of its own, its buffers counted."""
        audio_set = functools.partial(AudioGraphs, self.audio_encoder)
        costs = {"audio": graph_peaks(audio_set, audio, self.device, AudioGraphs.scaled_costs)}
        if (encoder := self.vision_encoder) is not None:
            costs["vision"] = graph_peaks(
                lambda b: VisionGraphs(encoder, int_buckets([b])),
                vision,
                self.device,
                VisionGraphs.scaled_costs,
            )
        return costs

    def capture_graphs(self, audio: list[int], vision: list[int], pool: Any = None) -> None:
        """Capture the audio graphs for window buckets `audio` and the vision graphs for patch buckets `vision`
        in one memory pool (`pool`, e.g. the LLM stage's: the encoders run between its steps, and their rows
        are copied out of the pool at once). Off CUDA the same buckets run static-eager, for tests.

        Half precision only on a GPU: float32 segments would be read back to the host inside the capture."""
        dtype = next(self.audio_encoder.parameters()).dtype
        if self.device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            log.warning("encoder CUDA graphs need bfloat16 or float16; the encoders run eagerly")
            return
        with torch.inference_mode():
            if audio:
                self.audio_graphs = AudioGraphs(self.audio_encoder, max(audio))
                self.audio_graphs.capture(audio, pool)
                pool = pool or self.audio_graphs.pool
            if vision and self.vision_encoder is not None:
                self.vision_graphs = VisionGraphs(self.vision_encoder, vision)
                self.vision_graphs.capture(vision, pool)

    @property
    def captured(self) -> dict[str, list[int]]:
        """The captured buckets per tower: audio in windows, vision in patches."""
        return {
            "audio": int_buckets(self.audio_graphs.captured_buckets) if self.audio_graphs else [],
            "vision": int_buckets(self.vision_graphs.captured_buckets) if self.vision_graphs else [],
        }

    def stats(self) -> dict[str, int]:
        """The graphs captured per tower, and the clip cache's counts (the stage keeps no requests between
        calls)."""
        graphs = {f"{tower}_graphs": len(buckets) for tower, buckets in self.captured.items()}
        return graphs | self.cache.stats()

    def profile_floor(
        self,
        prefill: int,
        prefill_tokens: int,
        max_prompt_tokens: int,
        max_audios: int,
        max_images: int,
        rows_held: int = 0,
    ) -> Floor:
        """The phases of the largest media requests beside a text prefill step of `prefill` bytes (GPU only).

        Measures each tower on the largest input the processor admits; a request brings as many of them as
        its prompt (`max_prompt_tokens`) and the processor (`max_audios`, `max_images`) allow. The requests
        not yet prefilled hold `rows_held` bytes of rows at once, or the largest request's where they are
        more: `rows_limit`.
        """
        frames, audio = self.max_audio_frames, self.audio
        clip_tokens = self.audio_encoder.output_tokens(frames)
        clip = MultimodalInputs(
            audio_clips=[torch.randn(frames * audio.hop_length)],  # the features' scratch is measured too
            num_audio_tokens=[clip_tokens],
            pixel_values=None,
            image_grid_thw=None,
            num_image_tokens=[],
        )
        audio_peak, clip_bytes = self._measure([audio.token_id] * clip_tokens, clip)
        floor = Floor(
            prefill=prefill,
            prefill_tokens=prefill_tokens,
            audio_encoder=audio_peak,
            audio_outputs=clip_bytes,
            audio_clips=max(1, min(max_audios, max_prompt_tokens // clip_tokens)),
            audio_seconds=frames * audio.hop_length / audio.sample_rate,
            rows_held=rows_held,
        )
        if (images := self.images) is not None:
            grid = images.largest_grid
            tokens = merged_rows(grid, images.spatial_merge_size)
            image = MultimodalInputs(
                audio_clips=[],
                num_audio_tokens=[],
                pixel_values=torch.randint(0, 256, (math.prod(grid), images.patch_values), dtype=torch.uint8),
                image_grid_thw=torch.tensor([grid]),
                num_image_tokens=[tokens],
                image_norm=images.norm,
            )
            vision_peak, image_bytes = self._measure([images.token_id] * tokens, image)
            floor = replace(
                floor,
                vision_encoder=vision_peak,
                image_outputs=image_bytes,
                images=largest_inputs(max_prompt_tokens, tokens, max_images, self.videos is not None),
                image_size=(grid[2] * images.patch_size, grid[1] * images.patch_size),
            )
        self.rows_limit = floor.rows_limit
        return floor

    @torch.inference_mode()
    def _measure(self, token_ids: list[int], mm: MultimodalInputs) -> tuple[int, int]:
        """Peak bytes of encoding one prompt's media, and the bytes of the rows that stay held after it."""
        base = torch.cuda.memory_allocated(self.device)
        with device_peak(self.device) as peak:
            embeds = self.encode_many([(token_ids, mm)], cached=False)[0]
        held = torch.cuda.memory_allocated(self.device) - base
        del embeds
        torch.cuda.empty_cache()
        return peak.bytes, held

    def _place(self, token_ids: list[int], audio: torch.Tensor | None, seen: VisionRows) -> MultimodalEmbeds:
        """The prompt's placeholder rows for its encoders' outputs, found on the host (numpy: an admission places
        every prompt it admits, and torch's per-call cost on small host tensors is most of this one's) and
        copied to the device together."""
        ids = np.asarray(token_ids)
        none = np.zeros(len(ids), dtype=bool)
        is_audio = ids == self.audio.token_id
        is_image = ids == self.images.token_id if self.images is not None else none
        is_video = ids == self.videos.token_id if self.videos is not None else none
        for kind, mask, embeds in (
            ("audio", is_audio, audio),
            ("image", is_image, seen.image),
            ("video", is_video, seen.video),
        ):
            found = 0 if embeds is None else embeds.shape[0]
            if found != int(mask.sum()):
                raise InvalidRequest(
                    f"the prompt has {int(mask.sum())} {kind} placeholder tokens but its {kind} gives {found}"
                )
        audio_rows = np.flatnonzero(is_audio)
        vision_rows = np.flatnonzero(is_image | is_video)
        embeds, deepstack = seen.in_prompt_order(torch.from_numpy(is_image[vision_rows]))
        # the positions through one pinned buffer: their copy waits for nothing queued
        on_device = to_device_together(
            [torch.from_numpy(audio_rows), torch.from_numpy(vision_rows)], self.device
        )
        return MultimodalEmbeds(on_device[0], audio, on_device[1], embeds, deepstack, audio_rows, vision_rows)
