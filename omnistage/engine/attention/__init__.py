"""Attention backends behind one interface; models call `backend.forward` with an `AttentionMetadata`."""

from omnistage.engine.attention.backend import AttentionBackend
from omnistage.engine.attention.metadata import AttentionMetadata, Chunk
from omnistage.engine.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "Chunk", "TorchReferenceBackend"]
