"""The stateless encoder stage: audio and vision towers turning prompts' media into embedding rows.

Runs at admission, once for all the requests admitted together: every clip of every prompt goes through
the audio tower as one ragged batch and every image through the vision tower as another (the towers are
batch invariant, so a request's rows do not depend on its neighbours). The outputs replace the prompts'
placeholder embeddings during prefill (see ModelRunner) and, for images, feed the deepstack levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omnistage.errors import InvalidRequest
from omnistage.models.qwen3_omni.audio_encoder import load_audio_encoder
from omnistage.models.qwen3_omni.config import ThinkerConfig
from omnistage.models.qwen3_omni.vision_encoder import load_vision_encoder

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.processor import MultimodalInputs


@dataclass
class MultimodalEmbeds:
    """Encoder outputs of one prompt: the prompt rows they replace, and the deepstack levels of images."""

    audio_rows: torch.Tensor  # long [Na] prompt positions of audio placeholders
    audio_embeds: torch.Tensor | None  # [Na, H]
    image_rows: torch.Tensor  # long [Ni]
    image_embeds: torch.Tensor | None  # [Ni, H]
    deepstack: torch.Tensor | None  # [levels, Ni, H]


class EncoderEngine:
    def __init__(
        self,
        checkpoint_dir: Path,
        cfg: ThinkerConfig,
        dtype: torch.dtype,
        device: torch.device,
        load_format: str = "safetensors",
        seed: int = 0,
    ) -> None:
        self.cfg, self.device = cfg, device
        towers = dict(dtype=dtype, device=device, load_format=load_format, seed=seed)
        self.audio_encoder = load_audio_encoder(checkpoint_dir, **towers)
        self.vision_encoder = load_vision_encoder(checkpoint_dir, **towers)

    def encode(self, token_ids: list[int], mm: MultimodalInputs) -> MultimodalEmbeds:
        """Run the audio and vision encoders for one prompt; their rows must match its placeholders."""
        return self.encode_many([(token_ids, mm)])[0]

    @torch.inference_mode()
    def encode_many(self, prompts: list[tuple[list[int], MultimodalInputs]]) -> list[MultimodalEmbeds]:
        """The encoders over several prompts' media at once, one ragged batch per tower; per prompt, in order.

        Raises InvalidRequest when a prompt's placeholders and its media disagree (the caller retries the
        prompts one by one to fail only that one).
        """
        clips = [f.to(self.device) for _, mm in prompts for f in mm.audio_features]
        audio = iter(self.audio_encoder(clips) if clips else [])
        with_images = [mm for _, mm in prompts if mm.pixel_values is not None]
        image_parts: list = []
        if with_images:
            pixels = torch.cat([mm.pixel_values for mm in with_images]).to(self.device)
            image, levels = self.vision_encoder(pixels, torch.cat([mm.image_grid_thw for mm in with_images]))
            sizes = [sum(mm.num_image_tokens) for mm in with_images]
            if sum(sizes) != image.shape[0]:
                raise InvalidRequest(
                    f"the prompts' images give {image.shape[0]} rows but their placeholders count {sum(sizes)}"
                )
            image_parts = list(zip(image.split(sizes), torch.stack(levels).split(sizes, dim=1)))
        images = iter(image_parts)
        out = []
        for token_ids, mm in prompts:
            clip_rows = [next(audio) for _ in mm.audio_features]
            image, deepstack = next(images) if mm.pixel_values is not None else (None, None)
            out.append(self._place(token_ids, torch.cat(clip_rows) if clip_rows else None, image, deepstack))
        return out

    def _place(
        self, token_ids: list[int], audio: torch.Tensor | None, image: torch.Tensor | None, deepstack
    ) -> MultimodalEmbeds:
        ids = torch.tensor(token_ids)
        audio_rows = (ids == self.cfg.audio_token_id).nonzero().flatten()
        image_rows = (ids == self.cfg.image_token_id).nonzero().flatten()
        for kind, rows, embeds in (("audio", audio_rows, audio), ("image", image_rows, image)):
            found = 0 if embeds is None else embeds.shape[0]
            if found != len(rows):
                raise InvalidRequest(
                    f"the prompt has {len(rows)} {kind} placeholder tokens but its {kind} gives {found}"
                )
        return MultimodalEmbeds(
            audio_rows.to(self.device), audio, image_rows.to(self.device), image, deepstack
        )
