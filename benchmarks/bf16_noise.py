"""How far bf16 logits drift from float32 with random weights, by depth (CPU, transformers' thinker).

Context for the bf16 logit comparison in RESULTS.md: with random weights the drift grows with depth, so
two bf16 implementations of the 48-layer Thinker differ by more than float32 parity suggests.

    python benchmarks/bf16_noise.py
"""

from __future__ import annotations

import copy

import torch
from transformers import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from omnistage.models.qwen3_omni.tiny import tiny_config


def main() -> None:
    for layers in (2, 12, 48):
        config = tiny_config()
        config["thinker_config"]["text_config"]["num_hidden_layers"] = layers
        model = Qwen3OmniMoeThinkerForConditionalGeneration(
            Qwen3OmniMoeConfig(**config).thinker_config
        ).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                # as `fill_random_` fills the GPU benchmark's weights: matrices (experts included) scaled
                # by 1/sqrt(their input width), gains near 1
                noise = torch.randn(tuple(param.shape), generator=generator)
                if param.dim() == 1:
                    param.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
                else:
                    param.copy_(noise / param.shape[-1] ** 0.5)
            ids = torch.randint(1000, 150000, (1, 64), generator=generator)
            reference = model(input_ids=ids).logits[0, -1]
            low = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids).logits[0, -1].float()
        error = ((low - reference).abs().max() / reference.abs().max()).item()
        print(f"{layers} layers: transformers bf16 vs float32, max |diff| / max |logit| = {error:.3f}")


if __name__ == "__main__":
    main()
