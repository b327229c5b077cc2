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
    "gather_bytes",
]


def backend_for(
    device: torch.device, flash_prefill: bool = True, long_kernel: str = "flash"
) -> AttentionBackend:
    """The Triton backend on a CUDA device, the torch reference elsewhere. `flash_prefill`: prompt chunks over
    long contexts through a varlen kernel over their keys gathered (`long_prefill.py`): torch's FlashAttention
    where this torch has it (`long_kernel` "flash"), or omnistage's Triton one ("triton").

    The Triton one is imported here, only where it runs: a CPU install may have no Triton.
    """
    if device.type == "cuda":
        from omnistage.engine.attention.cuda import CudaAttentionBackend

        return CudaAttentionBackend(_varlen(device, long_kernel) if flash_prefill else None)
    return TorchReferenceBackend()


@functools.cache
def _varlen(device: torch.device, kernel: str):  # type: ignore[no-untyped-def]
    from omnistage.engine.attention.long_prefill import flash_varlen, triton_varlen

    if kernel not in ("flash", "triton"):
        raise ValueError(f"long_prefill_kernel must be flash or triton, got {kernel!r}")
    return flash_varlen(device) if kernel == "flash" else triton_varlen(device)


def gather_bytes(model: torch.nn.Module, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """What `model`'s attention may hold in a step beyond a profiled prefill step's peak (at no cached context):
    its backend's `scratch_bytes`."""
    found = (getattr(m, "backend", None) for m in model.modules())
    backends = [backend for backend in found if isinstance(backend, AttentionBackend)]
    return max((backend.scratch_bytes(kv_heads, head_dim, dtype) for backend in backends), default=0)
