"""Attention backends behind one interface; models call `backend.forward` with an `AttentionMetadata`."""

import torch

from omnistage.engine.attention.torch_ref import TorchReferenceBackend
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata, Chunk

__all__ = ["AttentionBackend", "AttentionMetadata", "Chunk", "TorchReferenceBackend", "backend_for"]


def backend_for(device: torch.device) -> AttentionBackend:
    """The Triton backend on a CUDA device, the torch reference elsewhere.

    The Triton one is imported here, only where it runs: a CPU install may have no Triton.
    """
    if device.type == "cuda":
        from omnistage.engine.attention.cuda import CudaAttentionBackend

        return CudaAttentionBackend()
    return TorchReferenceBackend()
