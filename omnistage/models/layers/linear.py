"""Projections that read the same input, run as one GEMM: at a decode step's few rows each GEMM is a kernel
launch of a few microseconds whatever its width, so q/k/v and gate/up are each one launch, not three and two.

The fused weight is the projections' weights stacked; each `nn.Linear` keeps its parameter as a view into it
(same names, no extra memory), so loading and `state_dict` still speak the checkpoint's names.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


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
        fuse = getattr(module, "fuse_projections", None)
        if module is not model and callable(fuse):
            fuse()


def project(x: torch.Tensor, weight: torch.Tensor, gemv_config: tuple[int, int, int] | None) -> torch.Tensor:
    """`F.linear(x, weight)`; one row on the GPU through the Triton GEMV (`kernels/gemv.py`) when
    `gemv_config` (block_n, block_k, num_warps) is set: where `adopt_gemv` measured it faster than cuBLAS."""
    if gemv_config is not None and x.is_cuda and x.numel() == x.shape[-1]:
        from omnistage.kernels.gemv import gemv

        return gemv(x.reshape(1, -1), weight, *gemv_config).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


class FusedProjection:
    """The projection of a weight `fuse_linears` made (q/k/v, gate/up): called as a linear without bias. A
    plain attribute, not a module: its weight is the fused parameters' storage, not a parameter of its own."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.gemv_config: tuple[int, int, int] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.gemv_config)


class GemvLinear(nn.Linear):
    """An `nn.Linear` without bias whose one-row calls on the GPU take the Triton GEMV (`kernels/gemv.py`)
    with the configuration `adopt_gemv` measured fastest (block_n, block_k, num_warps): what it puts where the
    GEMV beat cuBLAS for the projection's shape."""

    gemv_config: tuple[int, int, int] = (8, 0, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.gemv_config)


GEMV_MARGIN = 0.15  # the GEMV replaces cuBLAS where it is this much faster: not for noise


def adopt_gemv(model: nn.Module) -> list[str]:
    """Put every bias-free `nn.Linear` and `FusedProjection` of `model` on CUDA on the Triton GEMV where, timed
    here on one row in a CUDA graph, the GEMV's fastest configuration beats cuBLAS by more than GEMV_MARGIN (each
    shape timed once): a linear becomes a `GemvLinear` (the weight parameter moves over as it is: same name, same
    storage), a fused projection gets the configuration. Returns their names, and logs each shape's choice."""
    chosen: dict[tuple[int, int, torch.dtype], tuple[int, int, int] | None] = {}
    adopted = []
    for name, module in list(model.named_modules()):
        for attribute, fused in list(vars(module).items()):
            if isinstance(fused, FusedProjection) and fused.weight.is_cuda:
                fused.gemv_config = _fastest(fused.weight, chosen)
                if fused.gemv_config is not None:
                    adopted.append(f"{name}.{attribute}" if name else attribute)
        if type(module) is not nn.Linear or module.bias is not None or not module.weight.is_cuda:
            continue
        weight = module.weight
        # a projection fused into a larger GEMM (`fuse_linears`: its weight is part of another's storage) is
        # not called alone
        if (
            not weight.is_contiguous()
            or weight.untyped_storage().nbytes() != weight.numel() * weight.element_size()
        ):
            continue
        config = _fastest(weight, chosen)
        if config is not None:
            replacement = GemvLinear(module.in_features, module.out_features, bias=False, device="meta")
            replacement.weight = weight
            replacement.gemv_config = config
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, replacement)
            adopted.append(name)
    return adopted


def _fastest(
    weight: torch.Tensor, chosen: dict[tuple[int, int, torch.dtype], tuple[int, int, int] | None]
) -> tuple[int, int, int] | None:
    """The GEMV configuration for one row through `weight`, None where cuBLAS is as fast (memoised by shape)."""
    from omnistage.kernels.gemv import fastest_config, graph_us

    shape = (*weight.shape, weight.dtype)
    if shape not in chosen:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        with torch.inference_mode():
            cublas = graph_us(lambda: F.linear(x, weight))
            best = fastest_config(weight)
        chosen[shape] = best[0] if best is not None and best[1] < cublas * (1 - GEMV_MARGIN) else None
        log.info(
            "one row through %s: cuBLAS %.1f µs, GEMV %s; %s",
            tuple(weight.shape), cublas, "failed" if best is None else f"{best[1]:.1f} µs at {best[0]}",
            "GEMV" if chosen[shape] else "cuBLAS",
        )  # fmt: skip
    return chosen[shape]
