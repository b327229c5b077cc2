"""A token decoder and its encoders made ready to serve on their device, before their stage measures them: the
MoE kernel of every layer, the one-row projections on the Triton GEMV where it is faster, the decoder layers
compiled, and the vision tower's blocks compiled."""

from __future__ import annotations

import logging

import torch

from omnistage.engine.stages.decoder import TokenDecoder, torch_module
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.models.layers.linear import adopt_gemv
from omnistage.models.layers.moe import SparseMoeBlock

log = logging.getLogger(__name__)


def prepare_decoder(model: TokenDecoder, device: torch.device, moe_kernel: str, compile: bool) -> bool:
    """Prepare `model` to serve on `device` with `moe_kernel`; returns whether its layers were compiled (on a
    GPU, when `compile`)."""
    set_moe_kernel(model, moe_kernel)
    if device.type == "cuda":
        # a decode step at one row: each projection where the Triton GEMV streams it faster than cuBLAS
        adopted = adopt_gemv(torch_module(model))
        log.info("one-row projections on the Triton GEMV: %d (%s)", len(adopted), ", ".join(adopted[:4]))
    compiled = device.type == "cuda" and compile
    if compiled:
        # Regional compilation: the 48 identical decoder layers share one compiled graph, which fuses
        # the norms, rotary, routing and activation glue around the attention and MoE kernels.
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    return compiled


def prepare_encoders(encoders: EncoderStage, device: torch.device, compile: bool) -> None:
    """Compile the vision tower's blocks on a GPU, when `compile`. Its eager calls and its graphs both run them:
    the stage's floor measurement and graph capture compile them at start, once for any patch count. An eager
    720p frame pair's CUDA time was a third attention, a quarter GEMMs and the rest glue (benchmarks/RESULTS.md,
    "the vision tower per frame pair")."""
    if device.type == "cuda" and compile and encoders.vision_encoder is not None:
        encoders.vision_encoder.compile_regions()
        log.info("vision tower: its blocks' norms, rotary, residuals and activation compiled")


def set_moe_kernel(model: TokenDecoder, kernel: str) -> None:
    """Choose the GPU MoE kernel of every layer (captured decode graphs keep the one they recorded)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.kernel = kernel
