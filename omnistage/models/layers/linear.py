"""Projections that read the same input, run as one GEMM: at a decode step's few rows each GEMM is a kernel
launch of a few microseconds whatever its width, so q/k/v and gate/up are each one launch, not three and two.

The fused weight is the projections' weights stacked; each `nn.Linear` keeps its parameter as a view into it
(same names, no extra memory), so loading and `state_dict` still speak the checkpoint's names.
"""

from __future__ import annotations

import torch
from torch import nn


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One `[sum of out_features, in]` weight whose row blocks are the linears' weights, now views of it."""
    fused = torch.cat([linear.weight for linear in linears]).detach()
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = fused[start : start + rows]
        start += rows
    return fused


def fuse_projections(model: nn.Module) -> None:
    """Fuse every submodule of `model` that can (those with a `fuse_projections` method), after loading."""
    for module in model.modules():
        if module is not model and callable(getattr(module, "fuse_projections", None)):
            module.fuse_projections()
