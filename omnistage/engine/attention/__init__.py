"""Attention backends behind one interface; models call `backend.forward` with an `AttentionMetadata`."""

import functools

import torch

from omnistage.engine.attention.torch_ref import TorchReferenceBackend
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.attention_metadata import AttentionMetadata, Chunk

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "Chunk",
    "TorchReferenceBackend",
    "backend_for",
    "backend_of",
    "gather_bytes",
]


def backend_for(device: torch.device, flash_prefill: bool = True) -> AttentionBackend:
    """The Triton backend on a CUDA device, the torch reference elsewhere. `flash_prefill`: prompt chunks over
    long contexts through torch's FlashAttention where this torch has it (`long_prefill.py`).

    The Triton one is imported here, only where it runs: a CPU install may have no Triton.
    """
    if device.type == "cuda":
        from omnistage.engine.attention.cuda import CudaAttentionBackend

        return CudaAttentionBackend(_flash(device) if flash_prefill else None)
    return TorchReferenceBackend()


@functools.cache
def _flash(device: torch.device):  # type: ignore[no-untyped-def]
    from omnistage.engine.attention.long_prefill import flash_varlen

    return flash_varlen(device)


def backend_of(model: object) -> AttentionBackend:
    """The attention backend `model`'s layers call (the torch reference for a model with none)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        backend = getattr(module, "backend", None)
        if isinstance(backend, AttentionBackend):
            return backend
    return TorchReferenceBackend()


def gather_bytes(model: torch.nn.Module, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """What `model`'s attention may hold in a step beyond a profiled prefill step's peak (at no cached context):
    its backend's `scratch_bytes`."""
    return backend_of(model).scratch_bytes(kv_heads, head_dim, dtype)
