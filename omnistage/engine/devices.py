"""The device and dtype a stage's settings name, checked against the machine."""

from __future__ import annotations

import torch

from omnistage.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    """ "auto", "cpu", "cuda" (the current GPU) or "cuda:N", checked against the machine."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = (
            torch.cuda.current_device() if device == "cuda" and count else int(device.partition(":")[2] or 0)
        )
        if index >= count:
            raise ConfigError(f"device {device!r} was asked for but torch sees {count} CUDA device(s)")
        return torch.device("cuda", index)
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)
