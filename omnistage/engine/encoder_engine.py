"""The stateless encoder stage: audio and vision towers turning a prompt's media into embedding rows.

Runs once per request at admission; its outputs replace the prompt's placeholder embeddings during
prefill (see ModelRunner) and, for images, feed the deepstack levels.
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

    @torch.inference_mode()
    def encode(self, token_ids: list[int], mm: MultimodalInputs) -> MultimodalEmbeds:
        """Run the audio and vision encoders for one prompt; their rows must match its placeholders."""
        ids = torch.tensor(token_ids)
        audio_rows = (ids == self.cfg.audio_token_id).nonzero().flatten()
        image_rows = (ids == self.cfg.image_token_id).nonzero().flatten()
        audio = image = deepstack = None
        if mm.audio_features:
            audio = torch.cat(self.audio_encoder([f.to(self.device) for f in mm.audio_features]))
        if mm.pixel_values is not None:
            image, levels = self.vision_encoder(mm.pixel_values.to(self.device), mm.image_grid_thw)
            deepstack = torch.stack(levels)
        for kind, rows, embeds in (("audio", audio_rows, audio), ("image", image_rows, image)):
            found = 0 if embeds is None else embeds.shape[0]
            if found != len(rows):
                raise InvalidRequest(
                    f"the prompt has {len(rows)} {kind} placeholder tokens but its {kind} gives {found}"
                )
        return MultimodalEmbeds(
            audio_rows.to(self.device), audio, image_rows.to(self.device), image, deepstack
        )
