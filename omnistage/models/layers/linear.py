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


class GemvLinear(nn.Linear):
    """An `nn.Linear` without bias whose one-row calls on the GPU take the Triton GEMV (`gemv.py`): what
    `adopt_gemv` puts where it measured the GEMV faster than cuBLAS for the projection's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.numel() == x.shape[-1]:
            from omnistage.models.layers.gemv import gemv

            return gemv(x.reshape(1, -1), self.weight).reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)


GEMV_MARGIN = 0.15  # the GEMV replaces cuBLAS where it is this much faster: not for noise


def adopt_gemv(model: nn.Module) -> list[str]:
    """Make every bias-free `nn.Linear` of `model` on CUDA a `GemvLinear` where, timed here on one row in a CUDA
    graph, the GEMV beats cuBLAS by more than GEMV_MARGIN (each shape timed once); returns their names. The
    weight parameter moves over as it is: same name, same storage."""
    from omnistage.models.layers.gemv import gemv, graph_us

    faster: dict[tuple[int, int, torch.dtype], bool] = {}
    adopted = []
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or linear.bias is not None or not linear.weight.is_cuda:
            continue
        weight = linear.weight
        # a projection fused into a larger GEMM (`fuse_linears`: its weight is part of another's storage) is
        # not called alone
        if (
            not weight.is_contiguous()
            or weight.untyped_storage().nbytes() != weight.numel() * weight.element_size()
        ):
            continue
        shape = (*weight.shape, weight.dtype)
        if shape not in faster:
            x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
            with torch.inference_mode():
                cublas = graph_us(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
                ours = graph_us(lambda x=x, w=weight: gemv(x, w))
            faster[shape] = ours < cublas * (1 - GEMV_MARGIN)
        if faster[shape]:
            replacement = GemvLinear(linear.in_features, linear.out_features, bias=False, device="meta")
            replacement.weight = weight
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, replacement)
            adopted.append(name)
    return adopted
